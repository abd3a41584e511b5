"""One file per parallelism (FSDP2, tensor/sequence, context, pipeline, expert, float8, activation
checkpointing, compile) on DeviceMesh and DTensor; ``parallelize()`` applies them in order."""
