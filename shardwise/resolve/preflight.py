"""The last step of resolving a run: the checks that need files but no process group -- data,
tokenizer, run directory, the checkpoint to load -- so a bad run fails in one line before any work
starts, and the tokenizer and data plan the run then carries."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from shardwise import checkpoint
from shardwise.config.extras import require_extra
from shardwise.config.notice import notice
from shardwise.config.schema import Config, ConfigError, model_label
from shardwise.data.prepare import check_prepared, prepare_plan
from shardwise.data.tokenizer import load_tokenizer
from shardwise.launch import rundir
from shardwise.launch.resilience import restart_count
from shardwise.models import ModelArgs
from shardwise.models.lora import apply_lora, check_targets
from shardwise.models.presets import FAMILY_TOKENIZERS, vocab_beyond_padding
from shardwise.models.transformer import build_model
from shardwise.observe.routing import read_meta
from shardwise.observe.trace import rank_path, taken
from shardwise.parallel.float8 import float8_summary
from shardwise.resolve.checks import last_step
from shardwise.resolve.run import ResolvedRun
from shardwise.runtime.distributed import launched_world_size
from shardwise.runtime.machine import rank_threads


def check_mlflow(uri: str) -> None:
    """``metrics.mlflow``: a tracking URI MLflow can log to, checked before any work (an unreachable
    server would otherwise cost MLflow's minutes of retries, inside rank 0)."""
    flag = f"metrics.mlflow={uri}"
    require_extra("mlflow", flag)
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme == "sqlite" and not all(importlib.util.find_spec(m) for m in ("sqlalchemy", "alembic")):
        raise ConfigError(f"{flag}: a sqlite store needs the sqlalchemy and alembic packages: "
                          "pip install 'shardwise[mlflow]'")
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
        raise ConfigError(f"{flag}: MLflow refuses a folder store unless MLFLOW_ALLOW_FILE_STORE=true; "
                          "use a file instead: --metrics.mlflow=sqlite:///runs/mlflow.db")
    if scheme in ("http", "https") and os.environ.get("RANK", "0") == "0":
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).close()
        except OSError as e:
            why = getattr(e, "reason", e)
            raise ConfigError(f"{flag}: no MLflow server answers there ({why}): start one (`mlflow server "
                              "--port 5000`) or choose another --metrics.mlflow") from None
    if scheme not in ("sqlite", "file", "http", "https", "databricks"):
        raise ConfigError(f"{flag}: give a tracking URI: sqlite:///runs/mlflow.db (a file), "
                          "http://HOST:5000 (a server) or databricks")


def preflight(run: ResolvedRun) -> ResolvedRun:
    """Every check of ``run`` (what :func:`~shardwise.resolve.run.resolve_run` made of the config, its
    layout checked) that needs no process group -- data, tokenizer, run dir, the checkpoint to load,
    optional packages -- and the run with its tokenizer."""
    cfg, args, world_size = run.cfg, run.model, run.world  # (the run's config: what resolving chose)
    if run.device_type == "cpu":  # (the ranks are given the lowered count: launch.process, init_distributed)
        _, lowered = rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if lowered:
            notice(lowered)
    if run.compile_reason:
        notice(run.compile_reason)
    if cfg.lora.rank and (said := check_targets(args, cfg.lora)):  # (a target it refuses: one line here)
        notice(said)
    if cfg.float8.enabled:  # (here, not in resolve_run: the planner checks thousands of layouts)
        require_extra("float8", "float8.enabled=true")
        notice(float8_summary(build_model(args), cfg.float8, run.dims.tp))
    if cfg.metrics.wandb:
        require_extra("wandb", "metrics.wandb=true")
    if cfg.metrics.mlflow:
        check_mlflow(cfg.metrics.mlflow)
    run = with_data(run)
    tok, plan = run.tokenizer, run.data_plan
    check_tokenizer(cfg, args, tok.vocab_size)
    check_prepared(cfg.data, tok, plan)
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
    # Before any rank starts (inside ranks, each creates its own file exclusively: a rank's check
    # here could see another's new file)
    if cfg.debug.trace and launched_world_size() is None:
        for path in (rank_path(Path(cfg.debug.trace), r) for r in range(world_size)):
            if path.exists():
                raise taken(path)
    return run


def with_data(run: ResolvedRun) -> ResolvedRun:
    """``run`` with its tokenizer loaded and its data plan worked out, once per process: the data
    pipeline, the evaluator and the launcher take them from the run."""
    tok = load_tokenizer(run.cfg.data.tokenizer)
    return dataclasses.replace(run, tokenizer=tok, data_plan=prepare_plan(run.cfg.data, tok))


def needs_own_tokenizer(cfg: Config, args: ModelArgs, tokens: int) -> bool:
    """Whether a tokenizer of ``tokens`` ids is refused for this model (:func:`check_tokenizer`): a
    family's model (or an imported one) whose vocabulary is far larger."""
    return (not cfg.data.synthetic and vocab_beyond_padding(args.vocab_size, tokens)
            and bool(FAMILY_TOKENIZERS.get(cfg.model.name) or not cfg.model.name))


def check_tokenizer(cfg: Config, args: ModelArgs, tokens: int) -> None:
    """The tokenizer's ``tokens`` ids against the model's vocabulary: more ids than rows is refused;
    a family's model (or an imported one) on a tokenizer far smaller than its vocabulary is refused,
    naming both and the fix; a benchmark preset there trains with a notice."""
    if cfg.data.synthetic:  # (the ids are drawn over the model's own rows: no tokenizer is read)
        notice(f"data.synthetic: seeded random token ids over all {args.vocab_size:,} rows of the "
               "vocabulary; the losses compare layouts and steps, not learning")
        return
    if tokens > args.vocab_size:
        raise ConfigError(f"the tokenizer has {tokens} tokens but model.vocab_size="
                          f"{args.vocab_size}: raise model.vocab_size or use a smaller tokenizer")
    if not vocab_beyond_padding(args.vocab_size, tokens):
        return
    name, spec = cfg.model.name, cfg.data.tokenizer or "the shipped tokenizer"
    family = FAMILY_TOKENIZERS.get(name)
    if needs_own_tokenizer(cfg, args, tokens):
        raise ConfigError(f"model {model_label(cfg.model)} has a vocabulary of {args.vocab_size:,} but data."
                          f"tokenizer ({spec}) has {tokens:,} tokens: train it with its {family or 'own'} "
                          "tokenizer, --data.tokenizer DIR (a folder with its tokenizer.json), or on random "
                          "ids, --data.synthetic=true")
    notice(f"model {name} has {args.vocab_size:,} embedding rows and {spec} {tokens:,} ids: the rows "
           "beyond are never trained (a benchmark shape; --model.vocab_size matches them)")


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
        meta = read_meta(Path(d.routing_replay))
        t = cfg.training
        if (meta["global_batch"], meta["seq_len"]) != (t.global_batch, t.seq_len):
            raise ConfigError(f"debug.routing_replay '{d.routing_replay}' traced {meta['global_batch']} x "
                              f"{meta['seq_len']} tokens per step, this run has {t.global_batch} x "
                              f"{t.seq_len}: replay a trace of the same batch")
        if meta["steps"] < last_step(cfg):
            raise ConfigError(f"debug.routing_replay '{d.routing_replay}' traced {meta['steps']} steps, this "
                              f"run has {last_step(cfg)}: lower training.steps or record a longer reference")


def check_run_dir(cfg: Config, run_dir: Path, args: ModelArgs) -> None:
    """What this run may do in ``run_dir``, and the checkpoint it would load.

    - ``checkpoint.resume`` continues the run in run.dir (from its newest checkpoint that verifies,
      or from ``checkpoint.path``); ``run.overwrite`` deletes it (what the run record lists, never
      the checkpoint to load; refused for a folder that never held a run) and starts over; asking
      for both is an error.
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
    if cfg.run.overwrite and not restarted:
        rundir.overwrite_plan(run_dir)  # a folder that never held a run, a link on the way: refused
    if not (c.resume or restarted or cfg.run.overwrite) and (what := rundir.prior_run(run_dir)):
        raise ConfigError(f"run.dir '{run_dir}' already holds a run ({what}): pass --checkpoint.resume "
                          "true to continue it, --run.overwrite true to delete it and start over, or "
                          "choose another --run.dir")
    found = checkpoint.list_checkpoints(run_dir / "checkpoints")
    candidates, explicit = load_candidates(cfg, run_dir)
    if explicit:
        path = candidates[0]
        if path.exists() and not path.is_dir():
            raise ConfigError(f"checkpoint.path '{path}' is a file, not a checkpoint: point it at a step-<N> "
                              "directory")
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
    model = build_model(args)
    if check_lora_start(path, cfg):  # resuming a LoRA run: its adapters are in the checkpoint too
        apply_lora(model, cfg.lora)
    checkpoint.check_compatible(path, model)
    checkpoint.check_same_function(path, cfg.model)


def check_lora_start(path: Path, cfg: Config) -> bool:
    """Whether checkpoint ``path`` holds LoRA adapters, which this run's ``[lora]`` must match (one line
    naming the field if not). A checkpoint without adapters is a base for a LoRA run (fresh adapters),
    except when resuming: that run trained every weight."""
    saved, ours = checkpoint.manifest_lora(checkpoint.read_manifest(path), path), cfg.lora
    if saved is None:
        if ours.rank and cfg.checkpoint.resume:
            raise ConfigError(f"checkpoint.resume: '{path}' trained every weight (no LoRA adapters): resume "
                              "it with lora.rank=0, or start LoRA from it in a new run.dir with "
                              f"--checkpoint.path {path}")
        return False
    if not ours.rank:
        flags = f"--lora.rank={saved.rank} --lora.alpha={saved.alpha:g} --lora.targets={saved.targets}"
        raise ConfigError(f"checkpoint '{path}' holds LoRA adapters (lora.rank={saved.rank}): load it with "
                          f"the [lora] it was trained with ({flags}), or export it merged (shardwise convert "
                          "--to-hf) and train every weight from that (checkpoint.initial_hf)")
    for name in ("rank", "alpha", "targets"):
        theirs, mine = getattr(saved, name), getattr(ours, name)
        if theirs != mine:
            raise ConfigError(f"checkpoint '{path}' was trained with lora.{name}={theirs}, this run has "
                              f"lora.{name}={mine}: pass --lora.{name}={theirs}")
    return True


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


