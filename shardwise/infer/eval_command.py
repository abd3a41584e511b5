"""``shardwise eval``: a checkpoint's loss and perplexity over every whole global batch of a data set,
prepared as training prepares it, on one rank or in any layout (:func:`evaluate_checkpoint`); or,
with ``--tasks``, lm-evaluation-harness tasks through infer/harness.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.checkpoint import checkpoint_or_latest, load_weights, read_manifest, run_config
from shardwise.checkpoint.manifest import manifest_lora, manifest_model_config
from shardwise.config.outputs import target
from shardwise.config.schema import ConfigError, LoRAConfig
from shardwise.data.dataset import check_vocab, open_corpus, refuse_synthetic
from shardwise.data.prepare import prepare
from shardwise.infer.generate import load_for_generation
from shardwise.infer.harness import run_tasks, task_manager
from shardwise.launch.agent import launch, strip_launcher_flags
from shardwise.ops.cpu_bf16 import use_fp32_gemms_for_bf16
from shardwise.resolve.checks import load_config
from shardwise.resolve.preflight import with_data
from shardwise.resolve.run import ResolvedRun, resolve_run
from shardwise.runtime.distributed import init_distributed, launched_world_size
from shardwise.trainer.build import batch_sharder, build_pipe, build_rank_model
from shardwise.trainer.evaluate import score
from shardwise.trainer.loss import TokenLoss


@dataclass(frozen=True)
class Score:
    """One data source's (or the whole set's) loss over the tokens it scored."""

    name: str
    loss: float
    tokens: int
    sequences: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


def evaluate_checkpoint(run: ResolvedRun, checkpoint: Path, split: str) -> list[Score]:
    """``checkpoint``'s weights in ``run``'s layout on this process group (started here if there is
    none), scored on each source of its data -- the held-out part (``split`` val) or all of it (all)
    -- in whole global batches; the last entry is the whole set, token-weighted. ``run`` carries its
    tokenizer and data plan."""
    cfg = run.cfg
    env = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.run.cpu_memory_cache)
    if env.world_size != run.world:
        raise ConfigError(f"eval was resolved for {run.world} ranks but runs on {env.world_size}")
    use_fp32_gemms_for_bf16(env.device.type, run.precision)
    run.dims.build_mesh(env.device.type, cfg.parallel.backend_override)
    corpus = open_corpus(cfg.data, run.tokenizer, plan=run.data_plan)
    check_vocab(corpus.max_token, run.model.vocab_size)
    t = cfg.training
    parts = [(name, [v] if split == "val" else [tr, v])
             for name, tr, v in zip(corpus.names, corpus.train, corpus.val, strict=True)]
    if cfg.data.val_path:  # a held-out file of its own
        parts = [("val_path", corpus.val)] if split == "val" else parts + [("val_path", corpus.val)]
    counts = [(name, streams, [s.num_windows(t.seq_len) // t.global_batch for s in streams])
              for name, streams in parts]
    if not any(sum(n) for _, _, n in counts):
        windows = sum(s.num_windows(t.seq_len) for _, streams in parts for s in streams)
        raise ConfigError(f"the {split} data has {windows} sequences of {t.seq_len} tokens, fewer than one "
                          f"global batch ({t.global_batch}): lower --training.global_batch (or "
                          "--training.seq_len), or give more data")
    model = build_rank_model(run, env.device)
    load_weights(checkpoint, model, cfg.checkpoint.verify_checksums)
    model.eval()
    pipe, shard = build_pipe(model, run, env.device), batch_sharder(run.dims, cfg.parallel.cp_load_balance)
    loss = TokenLoss(run.loss_chunk, compiled=run.compile)
    out, total = [], torch.zeros(2, dtype=torch.float64)
    for name, streams, n in counts:
        sums = torch.zeros(2, dtype=torch.float64)
        for stream, batches in zip(streams, n, strict=True):
            if batches:
                sums += score(model, run, [stream], [1.0], batches, loss, env.device, pipe, shard).cpu()
        if sums[1] > 0:
            out.append(Score(name, float(sums[0] / sums[1]), int(sums[1]), sum(n) * t.global_batch))
        total += sums
    out.append(Score("all", float(total[0] / total[1]), int(total[1]),
                     sum(s.sequences for s in out)))
    return out


def eval_command(args: argparse.Namespace, overrides: list[str], argv: list[str],
             rank_main: Callable[..., None]) -> int:
    """``shardwise eval``: on one rank, on ``--nproc`` local ranks (``rank_main`` runs this command
    in each), or as a rank under torchrun."""
    path = Path(args.checkpoint)
    if not path.exists():
        raise ConfigError(f"--checkpoint '{path}' does not exist")
    # rank 0 writes it (checked here, before any work, by the launcher and rank 0)
    args.out_target = (target(args.out, "--out", args.overwrite, folder=False)
                       if args.out and os.environ.get("RANK", "0") == "0" else None)
    if args.tasks:
        return lm_eval_tasks(args, overrides, argv, rank_main)
    ckpt = checkpoint_or_latest(path)
    cfg = load_config(args.config or run_config(ckpt), overrides)
    cfg.checkpoint.verify_checksums = cfg.checkpoint.verify_checksums and not args.skip_checksums
    manifest = read_manifest(ckpt)
    cfg.model = manifest_model_config(manifest, ckpt)  # the checkpoint's own shape
    cfg.lora = manifest_lora(manifest, ckpt) or LoRAConfig()  # and adapters
    refuse_synthetic(cfg.data)  # (before any rank starts)
    if not any(o.startswith("--compile.") for o in overrides):
        cfg.compile.enabled = False  # one forward pass over the data does not repay a compile
    named = any(o.startswith(("--data.path", "--data.sources", "--data.val_path")) for o in overrides)
    split = args.split if args.split != "auto" else "all" if named else "val"
    world = launched_world_size()
    if world is not None and args.nproc is not None:
        raise ConfigError("--nproc cannot be used under torchrun: the launcher sets the ranks")
    nproc = args.nproc if args.nproc is not None else world or 1
    run = resolve_run(cfg, nproc)  # layout errors here, before any process starts
    run = with_data(run)  # (the tokenizer and data plan, once per process)
    if world is None and nproc > 1:
        prepare(run.cfg.data, run.tokenizer, plan=run.data_plan)  # once, here; the ranks memory-map it
        with tempfile.TemporaryDirectory(prefix="shardwise-eval-") as tmp:
            return launch(strip_launcher_flags(argv), nproc, 0, tmp, rank_main)
    scores = evaluate_checkpoint(run, ckpt, split)
    if dist.get_rank() == 0:
        t = run.cfg.training
        record = {"checkpoint": str(ckpt), "split": split, "seq_len": t.seq_len,
                  "global_batch": t.global_batch,
                  "scores": [{**dataclasses.asdict(s), "perplexity": s.perplexity} for s in scores]}
        _write(args, record)
        if args.json:
            print(json.dumps(record))
        else:
            print(f"{ckpt} on {split} data, sequences of {t.seq_len} tokens in batches of {t.global_batch}:")
            for s in scores:
                print(f"  {s.name}: loss {s.loss:.4f}, perplexity {s.perplexity:.2f} ({s.tokens:,} tokens, "
                      f"{s.sequences} sequences)")
    return 0


def lm_eval_tasks(args: argparse.Namespace, overrides: list[str], argv: list[str],
                  rank_main: Callable[..., None]) -> int:
    """``eval --tasks``: lm-evaluation-harness tasks on the checkpoint, on one device or data parallel
    on ``--nproc`` local ranks (or under torchrun): each rank loads the model and answers its share
    of the requests; rank 0 prints the metrics."""
    if overrides:
        raise ConfigError("eval --tasks scores the checkpoint as it is: drop the config overrides "
                          f"({overrides[0]}); the tokenizer is the run's")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    world = launched_world_size()
    if world is not None and args.nproc is not None:
        raise ConfigError("--nproc cannot be used under torchrun: the launcher sets the ranks")
    tasks = [t for t in args.tasks.split(",") if t]
    manager = task_manager(tasks, args.tasks_path)  # (before the model: a typo answers at once)
    nproc = args.nproc if args.nproc is not None else world or 1
    if world is None and nproc > 1:
        with tempfile.TemporaryDirectory(prefix="shardwise-eval-") as tmp:
            return launch(strip_launcher_flags(argv), nproc, 0, tmp, rank_main)
    if world is not None:  # a rank: the group the harness splits the requests over
        init_distributed("auto")
    loaded = load_for_generation(checkpoint=args.checkpoint, checksums=not args.skip_checksums)
    results = run_tasks(loaded, tasks, manager, args.limit, args.num_fewshot, args.batch_size)
    if results is None:  # (not rank 0)
        return 0
    record = {"checkpoint": loaded.source, "tasks": results}
    _write(args, record)
    if args.json:
        print(json.dumps(record))
    else:
        for task, metrics in results.items():
            print(f"{task}: " + ", ".join(f"{k.removesuffix(',none')} {v:.4f}" for k, v in metrics.items()
                                         if isinstance(v, float)))
    return 0


def _write(args: argparse.Namespace, record: dict) -> None:
    """``--out``: the scores' JSON record (what ``--json`` prints) written to that file, at rank 0."""
    if args.out_target is not None:
        args.out_target.write(json.dumps(record, indent=1) + "\n")
