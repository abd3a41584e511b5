"""Checkpoints that never lose work, on ``torch.distributed.checkpoint`` (DCP).

Layout: ``<run.dir>/checkpoints/step-<N>/`` holds the DCP files (every rank writes its own shards
of model, optimizer, LR scheduler, data position and step), ``rng-rank<R>.pt`` (each rank's RNG
state) and ``manifest.json`` (step, layout, model shape, and every file's size and SHA-256).

Atomic commit: a save is written into ``step-<N>.tmp``; once every rank's files are on disk and
fsynced, rank 0 writes the manifest into it and renames the directory to ``step-<N>``. A rename
is atomic, so a ``step-<N>`` directory is complete whatever moment a crash or ``kill -9`` hits;
leftover ``.tmp`` directories (and ``.deleting`` ones from retention) are skipped with a warning
and swept at the next save. Loading checks the manifest first: sizes always, checksums with
``checkpoint.verify_checksums`` (each rank hashes its share of the files).

Async save (``checkpoint.async_mode = thread | process``): the state is copied to host memory
before :meth:`Checkpointer.save` returns (so later steps cannot change what is saved), then
written and committed in the background on a dedicated gloo process group -- sharing the training
group with a background thread would interleave its collectives with training's.
"""

from shardwise.checkpoint.manifest import (
    MANIFEST,
    TRAINING_ONLY_FIELDS,
    CheckpointError,
    check_files,
    check_same_function,
    checkpoint_or_latest,
    file_problem,
    list_checkpoints,
    looks_intact,
    manifest_lora,
    model_only,
    problem,
    read_manifest,
    run_config,
    set_aside,
    sha256,
    verify,
)
from shardwise.checkpoint.reader import (
    ModelTensors,
    SafePlanner,
    SafeReader,
    check_compatible,
    load,
    load_model_only,
    load_weights,
    read_model_tensors,
    saved_shapes,
    verify_distributed,
)
from shardwise.checkpoint.saver import Checkpointer, retired, rng_state, save_model_only, set_rng_state

__all__ = [
    "MANIFEST",
    "TRAINING_ONLY_FIELDS",
    "CheckpointError",
    "Checkpointer",
    "SafePlanner",
    "ModelTensors",
    "SafeReader",
    "check_compatible",
    "check_files",
    "check_same_function",
    "checkpoint_or_latest",
    "load_weights",
    "run_config",
    "file_problem",
    "list_checkpoints",
    "load",
    "load_model_only",
    "looks_intact",
    "manifest_lora",
    "model_only",
    "problem",
    "read_manifest",
    "read_model_tensors",
    "retired",
    "rng_state",
    "save_model_only",
    "saved_shapes",
    "set_aside",
    "set_rng_state",
    "sha256",
    "verify",
    "verify_distributed",
]
