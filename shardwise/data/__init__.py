"""Data: sources read in parallel and tokenized once into memory-mapped shards, chat rendering and
packing, and the loader that resumes exactly."""
