"""Tokens/s and communication volume per step for each layout at one world size.

Each layout is a real ``shardwise train --nproc N`` run of the debug preset (bf16, 8 x 512 tokens
per step) with ``--debug.comm`` on its first step. Throughput is the median of the logged tokens/s
over the steps after warm-up; communication is the per-step buffer bytes per mesh dim from
comm.json (see shardwise/observe/comm.py for what "buffer bytes" means).

    python bench/layouts.py                       # world size 4
    python bench/layouts.py --steps 12 --layouts dp_shard=4 tp=2,dp_shard=2
    python bench/layouts.py --layouts pp=2,dp_shard=2,training.micro_batch=2 pp=4,training.micro_batch=2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.resolve.layouts import parse_layout
from shardwise.verify.parity import run_dirname

DEFAULT = ["dp_shard=4", "dp_replicate=2,dp_shard=2", "tp=2,dp_shard=2", "tp=4", "tp=2,dp_replicate=2"]


def run(layout: str, steps: int, warmup: int, out: Path) -> dict:
    args, world = parse_layout(layout)
    run_dir = out / run_dirname(layout)
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", "configs/debug.toml",
           f"--nproc={world}", *args, f"--run.dir={run_dir}", "--run.overwrite=true",
           f"--training.steps={steps}", "--lr_scheduler.warmup_steps=2", "--eval.interval=0",
           "--checkpoint.interval=0", "--checkpoint.final=false", "--metrics.log_format=line",
           "--metrics.tensorboard=false", "--metrics.plot=false", "--debug.comm=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
        raise SystemExit(f"{layout}: {errors[-1] if errors else proc.stderr[-500:]}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    comm = json.loads((run_dir / "comm.json").read_text())["totals"]
    return {"world": world, "tps": statistics.median(r["tokens_per_s"] for r in rows[warmup:]),
            "comm": {dim: sum(per.values()) for dim, per in comm.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=DEFAULT)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="logged steps left out of the median")
    a = p.parse_args()
    print("| layout | ranks | tokens/s (all ranks) | MiB/step by mesh dim (rank 0, buffer bytes) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts:
            r = run(layout, a.steps, a.warmup, Path(tmp))
            comm = ", ".join(f"{d}: {b / 2**20:.1f}" for d, b in sorted(r["comm"].items()))
            print(f"| {layout} | {r['world']} | {r['tps']:,.0f} | {comm} |", flush=True)


if __name__ == "__main__":
    main()
