"""What this process runs on: the machine (device, cores, CPU features, allocator settings) and the
process group it joins."""
