"""A LoRA step beside a full fine-tuning step of the same model, batch and layout: peak memory,
the parts the first step's breakdown names (parameters, gradients, optimizer states), and step
time, read from each run's own metrics.

Both runs are ``shardwise train`` on the shipped corpus, one after the other in fresh processes
(each from the same seed), ``--steps`` steps each; the step time is the median of the steps after
the first (which pays start-up).

    python bench/lora.py                                   # 125m, 4 x 1024 tokens, r = 16
    python bench/lora.py --preset 1b --batch 2 --seq 1024 --steps 4 --rank 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(preset: str, batch: int, seq: int, steps: int, extra: list[str], out: Path) -> dict:
    """One ``shardwise train`` run; its peak memory, breakdown and median step time."""
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", str(ROOT / "configs" / f"{preset}.toml"),
           f"--training.steps={steps}", f"--training.global_batch={batch}", f"--training.seq_len={seq}",
           "--training.mixed_precision=fp32", "--eval.interval=0", "--checkpoint.interval=0",
           "--checkpoint.final=false", "--metrics.tensorboard=false", "--metrics.plot=false",
           "--metrics.log_format=json", "--compile.enabled=false", f"--run.dir={out}", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    parts = json.loads((out / "memory_breakdown.json").read_text())
    return {"peak_gib": max(r["memory_gib"] for r in rows), "parts": parts,
            "step_s": statistics.median(r["step_time_s"] for r in rows[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        full = run(a.preset, a.batch, a.seq, a.steps, [], Path(tmp) / "full")
        lora = run(a.preset, a.batch, a.seq, a.steps, [f"--lora.rank={a.rank}", f"--lora.alpha={2 * a.rank}"],
                   Path(tmp) / "lora")
    print(f"{a.preset}, {a.batch} x {a.seq} tokens, fp32, one rank; LoRA r={a.rank} on all-linear\n")
    print("| run | peak GiB | params GiB | grads GiB | optimizer GiB | step s |")
    print("|---|---|---|---|---|---|")
    for name, r in (("full fine-tune", full), (f"LoRA r={a.rank}", lora)):
        part = {k: max(r["parts"][f"{k}_per_rank"]) for k in ("params", "grads", "optimizer")}
        print(f"| {name} | {r['peak_gib']:.2f} | {part['params']:.3f} | {part['grads']:.3f} | "
              f"{part['optimizer']:.3f} | {r['step_s']:.2f} |")
    ratio = lora["peak_gib"] / full["peak_gib"], lora["step_s"] / full["step_s"]
    print(f"\nLoRA / full: peak {ratio[0]:.2f}x, step {ratio[1]:.2f}x")


if __name__ == "__main__":
    main()
