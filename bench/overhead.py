"""Host (Python + dispatcher) overhead of one training step.

A model so small that its kernels take almost no time (dim 64, 2 blocks, 1 x 16 tokens) runs the
real ``train_step`` -- FSDP2 on a one-rank mesh, fused AdamW, clipping, the loss all-reduce -- so the
step time is nearly all host overhead: Python, torch's dispatcher, FSDP's hooks, autograd. The
script reports the median step time, the aten ops dispatched per step, and a cProfile breakdown
that splits the time between torch's components and shardwise's own code (what this project can
cache or remove).

    python bench/overhead.py                  # the debug preset's layers, shrunk
    python bench/overhead.py --document-mask  # with a per-step document mask
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += 1
        return func(*args, **(kwargs or {}))


def component(filename: str) -> str:
    """Which part of the stack a profiled function belongs to."""
    if "/shardwise/" in filename:
        return "shardwise"
    for key, name in (("fsdp", "torch FSDP2"), ("distributed/tensor", "torch DTensor"),
                      ("optim", "torch optimizer"), ("autograd", "torch autograd"),
                      ("distributed", "torch.distributed (other)"), ("torch/nn", "torch.nn modules")):
        if key in filename:
            return name
    if filename.startswith("~") or filename == "<built-in>":
        return "C++ ops (kernels + dispatch, called from Python)"
    return "other Python"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--document-mask", action="store_true")
    a = p.parse_args()

    from shardwise.data.dataset import Batch
    from shardwise.optim.adamw import build_optimizer
    from shardwise.optim.lr import build_lr_scheduler
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.run import resolve_run
    from shardwise.trainer.build import build_rank_model
    from shardwise.trainer.loss import TokenLoss
    from shardwise.trainer.train import train_step

    torch.set_num_threads(1)  # kernels are tiny; one thread avoids pool wake-ups in the figure
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
    cfg = load_config("configs/debug.toml", ["--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=4",
                                             "--model.n_layers=2", "--training.seq_len=16",
                                             "--training.global_batch=1", "--training.mixed_precision=fp32"])
    run = resolve_run(cfg, 1)
    run.dims.build_mesh("cpu")
    model = build_rank_model(run, "cpu")
    opt = build_optimizer(model, cfg.optimizer, "cpu")
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, 10_000)
    tokens = torch.randint(0, 2000, (1, 16))
    doc_ids = torch.tensor([[0] * 8 + [1] * 8]) if a.document_mask else None
    batches = [Batch(tokens, tokens.roll(-1, 1), doc_ids, 16)]

    def step() -> None:
        train_step(model, opt, sched, batches, run, TokenLoss())

    for _ in range(5):
        step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    ops = _Ops()
    with ops:
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    by_part: dict[str, float] = defaultdict(float)
    ours: Counter[str] = Counter()
    calls = 0
    for (filename, line, name), (_, nc, tottime, _, _) in stats.items():
        by_part[component(filename)] += tottime / 10
        calls += nc
        if "/shardwise/" in filename:
            ours[f"{filename.split('/shardwise/')[-1]}:{line} {name}"] += tottime / 10
    total = sum(by_part.values())

    print(f"median step {statistics.median(times) * 1e3:.2f} ms over {a.steps} steps "
          f"(document mask: {a.document_mask}); {ops.n} aten ops and {calls // 10} Python calls per step\n")
    print("| part of the stack | ms per step (self time, cProfile) | share |")
    print("|---|---|---|")
    for part, t in sorted(by_part.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {t * 1e3:.2f} | {t / total:.0%} |")
    print("\nshardwise's own functions, self time per step:")
    for name, t in ours.most_common(8):
        print(f"  {t * 1e3:7.3f} ms  {name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
