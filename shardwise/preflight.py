"""Checks that need no process group -- layout, batch split, pipeline schedule, data, tokenizer,
run directory, the checkpoint to load -- so a bad run fails in one line before any work starts."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from shardwise import checkpoint
from shardwise.config import Config, ConfigError, TrainingConfig
from shardwise.data.dataset import data_files
from shardwise.data.tokenizer import load_tokenizer
from shardwise.models import ModelArgs, build_model, model_args
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.pipeline import SCHEDULES, stages_per_rank
from shardwise.resilience import restart_count


def micro_batches_per_rank(t: TrainingConfig, dp: int) -> int:
    """Gradient-accumulation steps per optimizer step (the pipeline's micro-batches under PP)."""
    return t.global_batch // dp // micro_batch_size(t, dp)


def micro_batch_size(t: TrainingConfig, dp: int) -> int:
    if t.global_batch % dp:
        raise ConfigError(f"training.global_batch={t.global_batch} must be divisible by the "
                          f"data-parallel degree dp_replicate*dp_shard={dp}")
    per_rank = t.global_batch // dp
    mb = t.micro_batch or per_rank
    if per_rank % mb:
        raise ConfigError(f"training.micro_batch={mb} must divide the per-rank batch "
                          f"global_batch/dp={per_rank}")
    return mb


def check_layout(cfg: Config, world_size: int) -> ParallelDims:
    """The layout checks: degrees against the world, the model, the batch split and the pipeline
    schedule, and the features a layout cannot combine with (the planner filters with this too)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.check_model(model_args(cfg.model), cfg.training.seq_len)
    check_pipeline(cfg, dims, micro_batches_per_rank(cfg.training, dims.dp))
    if cfg.training.loss_chunk and dims.pp > 1:
        raise ConfigError("training.loss_chunk with parallel.pp > 1 is not available (the pipeline "
                          "schedule computes the loss on the last stage's logits): set training.loss_chunk=0")
    if dims.cp > 1 and cfg.data.document_mask:
        raise ConfigError("data.document_mask with parallel.cp > 1 is not available (the ring "
                          "attention is causal-only): set data.document_mask=false or cp=1")
    return dims


def preflight(cfg: Config, world_size: int) -> ParallelDims:
    """Every check that needs no process group: layout, batch split, data, tokenizer, run dir."""
    dims = check_layout(cfg, world_size)
    args = model_args(cfg.model)
    data_files(cfg.data.path)
    if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.wandb=true needs the wandb package: pip install wandb (or "
                          "shardwise[wandb]), or set metrics.wandb=false")
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size="
                          f"{args.vocab_size}: raise model.vocab_size or use a smaller tokenizer")
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir '{run_dir}' exists and is not a directory")
    probe = run_dir if run_dir.exists() else next(p for p in run_dir.absolute().parents if p.exists())
    if not probe.is_dir():
        raise ConfigError(f"run.dir '{run_dir}' cannot be created: '{probe}' is a file; choose another "
                          "--run.dir")
    try:  # a real write: permission bits say nothing to root, nor about read-only mounts
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(f"run.dir '{run_dir}' is not writable ({e.strerror}): choose another "
                          "--run.dir") from None
    check_checkpoint(cfg, run_dir, args)
    return dims


def check_checkpoint(cfg: Config, run_dir: Path, args: ModelArgs) -> None:
    """The checkpoint this run would load: complete, files of the recorded sizes, and saved from a
    model of this shape (each parameter's name and shape). Checksums are checked at load time,
    split over the ranks."""
    found = checkpoint.list_checkpoints(run_dir / "checkpoints")
    resuming = cfg.checkpoint.resume or restart_count() > 0
    if found and not resuming and not cfg.run.overwrite and not cfg.checkpoint.path:
        raise ConfigError(f"run.dir '{run_dir}' already has checkpoints: pass --checkpoint.resume "
                          "true to continue, --run.overwrite true to start over, or another --run.dir")
    if cfg.checkpoint.path:
        path = Path(cfg.checkpoint.path)
        if not path.is_dir():
            raise ConfigError(f"checkpoint.path '{path}' does not exist: point it at a step-<N> directory")
        if problem := checkpoint.check_files(path, checkpoint.read_manifest(path), checksums=False):
            raise checkpoint.CheckpointError(problem)
    else:  # resuming: the newest checkpoint whose files have their recorded sizes (resume() skips
        # the damaged ones with a warning)
        intact = [p for _, p in reversed(found) if resuming and checkpoint.looks_intact(p)]
        if not intact:
            return
        path = intact[0]
    checkpoint.check_compatible(path, build_model(args))


def check_pipeline(cfg: Config, dims: ParallelDims, n_microbatches: int) -> None:
    if dims.pp == 1:
        return
    pc = cfg.parallel
    if pc.pp_schedule not in SCHEDULES:  # (the config's choices list them; kept for API callers)
        raise ConfigError(f"parallel.pp_schedule={pc.pp_schedule} is not available; use one of "
                          f"{', '.join(SCHEDULES)}")
    v = stages_per_rank(pc.pp_schedule, pc.pp_stages_per_rank)
    if v < 1 or dims.pp * v > cfg.model.n_layers:
        raise ConfigError(f"parallel.pp_schedule={pc.pp_schedule} needs pp*stages_per_rank={dims.pp * v} "
                          f"stages of at least one block, but model.n_layers={cfg.model.n_layers}: lower "
                          "pp or parallel.pp_stages_per_rank")
    rounds = max(1, n_microbatches // dims.pp)
    if pc.pp_schedule == "dualpipev" and n_microbatches < 2 * dims.pp:
        raise ConfigError(f"parallel.pp_schedule=dualpipev needs at least 2*pp={2 * dims.pp} micro-batches "
                          f"per step (one per stage), got {n_microbatches}: lower training.micro_batch")
    if pc.pp_schedule == "interleaved1f1b" and n_microbatches % rounds:
        raise ConfigError(f"parallel.pp_schedule=interleaved1f1b needs the micro-batches per step "
                          f"({n_microbatches}) to be a multiple of max(1, micro-batches // pp)={rounds}: "
                          "change training.micro_batch")
    if cfg.data.document_mask:
        raise ConfigError("data.document_mask with parallel.pp > 1 is not available yet (the pipeline "
                          "feeds extra inputs to the first stage only): set data.document_mask=false")
    if cfg.parallel.pp_schedule == "1f1b" and n_microbatches < dims.pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least pp={dims.pp} micro-batches per step, "
                          f"got {n_microbatches}: lower training.micro_batch or use pp_schedule=gpipe")
