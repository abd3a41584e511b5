"""Checks that need no process group -- layout, batch split, pipeline schedule, data, tokenizer,
run directory, the checkpoint to load -- so a bad run fails in one line before any work starts."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from shardwise import checkpoint, rundir
from shardwise.config import Config, ConfigError, TrainingConfig
from shardwise.config_checks import notice
from shardwise.data.prepare import check_prepared
from shardwise.data.tokenizer import load_tokenizer
from shardwise.device import launched_world_size
from shardwise.models import ModelArgs, build_model, model_args
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.float8 import float8_summary
from shardwise.parallel.pipeline import stages_per_rank
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
    pipeline_micro_batch(cfg, dims)
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
    if cfg.float8.enabled:  # (here, not in check_layout: the planner checks thousands of layouts)
        notice(float8_summary(build_model(args), cfg.float8, dims.tp))
    if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.wandb=true needs the wandb package: pip install wandb (or "
                          "shardwise[wandb]), or set metrics.wandb=false")
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size="
                          f"{args.vocab_size}: raise model.vocab_size or use a smaller tokenizer")
    check_prepared(cfg.data, tok)
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
    check_run_dir(cfg, run_dir, args)
    check_routing(cfg, world_size, args)
    return dims


def check_routing(cfg: Config, world_size: int, args: ModelArgs) -> None:
    """debug.routing_record / routing_replay: an MoE model; recording on one rank; a replayed trace
    of the same batch shape that covers this run's steps."""
    d = cfg.debug
    if not (d.routing_record or d.routing_replay):
        return
    if not args.n_experts:
        raise ConfigError("debug.routing_record / debug.routing_replay trace MoE routing, but this model "
                          "has no experts (model.n_experts=0): drop them")
    if d.routing_record and d.routing_replay:
        raise ConfigError("debug.routing_record and debug.routing_replay: a run records or replays, not both")
    if d.routing_record and world_size != 1:
        raise ConfigError(f"debug.routing_record records on one rank (the reference), not {world_size}: "
                          "run it without --nproc")
    if d.routing_replay:
        from shardwise.observe.routing import read_meta

        meta = read_meta(Path(d.routing_replay))
        t = cfg.training
        if (meta["global_batch"], meta["seq_len"]) != (t.global_batch, t.seq_len):
            raise ConfigError(f"debug.routing_replay '{d.routing_replay}' traced {meta['global_batch']} x "
                              f"{meta['seq_len']} tokens per step, this run has {t.global_batch} x "
                              f"{t.seq_len}: replay a trace of the same batch")
        if meta["steps"] < t.steps:
            raise ConfigError(f"debug.routing_replay '{d.routing_replay}' traced {meta['steps']} steps, this "
                              f"run has {t.steps}: lower training.steps or record a longer reference")


def check_run_dir(cfg: Config, run_dir: Path, args: ModelArgs) -> None:
    """What this run may do in ``run_dir``, and the checkpoint it would load.

    - ``checkpoint.resume`` continues the run in run.dir (from its newest checkpoint that verifies,
      or from ``checkpoint.path``); ``run.overwrite`` deletes it (:data:`rundir.RUN_OUTPUTS`, but
      never the checkpoint to load) and starts over; asking for both is an error.
    - Otherwise run.dir must not hold an earlier run (checkpoints or logged steps), with or without
      ``checkpoint.path``: nothing is replaced unasked.
    - Resuming from a checkpoint older than run.dir's newest would put a second history beside the
      later checkpoints: refused.
    - The checkpoint to load is complete (sizes; checksums at load time, split over the ranks),
      saved from a model of this shape, and from a model config that computes the same function.
    """
    c = cfg.checkpoint
    if c.resume and cfg.run.overwrite:
        raise ConfigError("checkpoint.resume=true and run.overwrite=true contradict each other (resume "
                          "continues the run in run.dir, overwrite deletes it): pass one of them")
    if launched_world_size() is None:  # (under a launcher, the launcher or rank 0 takes the lock)
        rundir.probe(run_dir)
    restarted = restart_count() > 0
    if not (c.resume or restarted or cfg.run.overwrite) and (what := rundir.prior_run(run_dir)):
        raise ConfigError(f"run.dir '{run_dir}' already holds a run ({what}): pass --checkpoint.resume "
                          "true to continue it, --run.overwrite true to delete it and start over, or "
                          "choose another --run.dir")
    found = checkpoint.list_checkpoints(run_dir / "checkpoints")
    candidates, explicit = load_candidates(cfg, run_dir)
    if explicit:
        path = candidates[0]
        if not path.is_dir():
            raise ConfigError(f"checkpoint.path '{path}' does not exist: point it at a step-<N> directory")
        manifest = checkpoint.read_manifest(path)
        if problem := checkpoint.check_files(path, manifest, checksums=False):
            raise checkpoint.CheckpointError(problem)
        step = 0 if checkpoint.model_only(path) else int(manifest["step"])
        newer = [f"step-{s}" for s, p in found if s > step and p.resolve() != path.resolve()]
        if c.resume and newer:
            raise ConfigError(f"checkpoint.path '{path}' is step {step}, but run.dir '{run_dir}' has the "
                              f"later {', '.join(newer)}: resuming here would write a second history "
                              "over them; resume from the newest (drop checkpoint.path), continue in "
                              "another --run.dir, or drop them with --run.overwrite true (instead of "
                              "--checkpoint.resume)")
    elif candidates:
        intact = [p for p in candidates if checkpoint.looks_intact(p)]
        if not intact:
            raise no_good_checkpoint(run_dir, {p: checkpoint.problem(p) for p in candidates})
        path = intact[0]
    else:
        return
    checkpoint.check_compatible(path, build_model(args))
    checkpoint.check_same_function(path, cfg.model)


def load_candidates(cfg: Config, run_dir: Path) -> tuple[list[Path], bool]:
    """The checkpoints this run would load, newest first, and whether the user named one.

    A restart after a failure (``--max-restarts``) continues from run.dir's newest checkpoint --
    not from checkpoint.path, which it has trained past; ``checkpoint.resume`` takes
    ``checkpoint.path`` if given, else the newest that verifies; otherwise only checkpoint.path."""
    found = [p for _, p in reversed(checkpoint.list_checkpoints(run_dir / "checkpoints"))]
    if restart_count() > 0 and found:
        return found, False
    if cfg.checkpoint.path:
        return [Path(cfg.checkpoint.path)], True
    if cfg.checkpoint.resume or restart_count() > 0:
        return found, False
    return [], False


def no_good_checkpoint(run_dir: Path, problems: dict[Path, str]) -> checkpoint.CheckpointError:
    """None of run.dir's checkpoints can be resumed: name each and the ways on (one line)."""
    each = "; ".join(f"{p.name} {why}" for p, why in problems.items())
    return checkpoint.CheckpointError(
        f"checkpoint.resume: none of the {len(problems)} checkpoint(s) in '{run_dir / 'checkpoints'}' "
        f"verifies ({each}): point --checkpoint.path at a good checkpoint, or start over with "
        "--run.overwrite true")


def pipeline_micro_batch(cfg: Config, dims: ParallelDims) -> None:
    """With pipeline parallel and ``training.micro_batch`` unset (0, which means no accumulation),
    choose the micro-batch for the user and say so: the largest one that gives the schedule at
    least ``4 * pp`` micro-batches (1F1B's bubble ``(pp-1)/(m+pp-1)`` then stays under 20%;
    fewer sequences per rank: micro-batches of one) among those the schedule accepts."""
    t = cfg.training
    if t.micro_batch or dims.pp == 1:
        return
    per_rank = micro_batch_size(t, dims.dp)  # (checks that dp divides the batch)
    counts = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    want = min(4 * dims.pp, per_rank)
    for m in [m for m in counts if m >= want] + [m for m in reversed(counts) if m < want]:
        try:
            check_pipeline(cfg, dims, m)
        except ConfigError:
            continue
        t.micro_batch = per_rank // m
        bubble = (dims.pp - 1) / (m + dims.pp - 1)
        notice(f"parallel.pp={dims.pp}: training.micro_batch={t.micro_batch} ({m} micro-batches per step "
               f"through the {cfg.parallel.pp_schedule} schedule; 1F1B bubble (pp-1)/(m+pp-1) = "
               f"{bubble:.0%}); set training.micro_batch to choose")
        return
    t.micro_batch = 1  # none fits: the checks below name what the schedule needs


def check_pipeline(cfg: Config, dims: ParallelDims, n_microbatches: int) -> None:
    if dims.pp == 1:
        return
    pc = cfg.parallel
    v = stages_per_rank(pc.pp_schedule, pc.pp_stages_per_rank)
    if v < 1 or dims.pp * v > cfg.model.n_layers:
        raise ConfigError(f"parallel.pp_schedule={pc.pp_schedule} needs pp*stages_per_rank={dims.pp * v} "
                          f"stages of at least one block, but model.n_layers={cfg.model.n_layers}: lower "
                          "pp or parallel.pp_stages_per_rank")
    rounds = max(1, n_microbatches // dims.pp)
    if pc.pp_schedule == "dualpipev" and n_microbatches < 2 * dims.pp:
        raise ConfigError(f"parallel.pp_schedule=dualpipev needs at least 2*pp={2 * dims.pp} micro-batches "
                          f"per step (one per stage), got {n_microbatches}: lower training.micro_batch "
                          "or raise training.global_batch")
    if pc.pp_schedule == "interleaved1f1b" and n_microbatches % rounds:
        raise ConfigError(f"parallel.pp_schedule=interleaved1f1b needs the micro-batches per step "
                          f"({n_microbatches}) to be a multiple of max(1, micro-batches // pp)={rounds}: "
                          "change training.micro_batch")
    if cfg.data.document_mask:
        raise ConfigError("data.document_mask with parallel.pp > 1 is not available yet (the pipeline "
                          "feeds extra inputs to the first stage only): set data.document_mask=false")
    if cfg.parallel.pp_schedule == "1f1b" and n_microbatches < dims.pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least pp={dims.pp} micro-batches per step, "
                          f"got {n_microbatches}: lower training.micro_batch, raise training.global_batch "
                          "or use pp_schedule=gpipe")
