"""bf16 GEMMs on this CPU three ways, side by side in one process, in both layouts a linear layer runs
(the best rate over about a second, as the MFU peak measures it): fp32, torch's own bf16 kernel, and
bf16 as fp32 GEMMs of the bf16 values rounded once (shardwise/ops/cpu_bf16.py, which bf16 runs take on
CPUs without bf16 arithmetic); then, with ``--train``, a few steps of configs/debug.toml in bf16 and
in fp32 (tokens/s of the steps after the first, from each run's metrics.jsonl; with torch's own bf16
kernels, deepseek-debug's bf16 step took 51-53 s on an AVX2 EPYC, too long to sit beside).

    python bench/cpu_bf16.py                        # GEMMs at widths 256, 1024, 2048 (2 threads)
    python bench/cpu_bf16.py --train --steps 4      # and debug's training, bf16 beside fp32

On a CPU with bf16 arithmetic the last but one column measures the fp32 path all the same (runs there keep
torch's kernels). Prints a markdown table with the CPU kind.
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


def train_rate(steps: int, precision: str, extra: list[str]) -> float:
    """Median tokens/s of steps 2.. of configs/debug.toml on one rank in ``precision``."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "shardwise", "train", "--config", "configs/debug.toml",
               f"--run.dir={d}/run",
               f"--training.mixed_precision={precision}", f"--training.steps={steps}", "--eval.interval=0",
               "--checkpoint.interval=0", "--checkpoint.final=false", *extra]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(f"{d}/run/metrics.jsonl")]
        return statistics.median(r["tokens_per_s"] for r in rows if r["step"] > 1 and "tokens_per_s" in r)


def main() -> None:
    import torch
    import torch.nn.functional as F

    from shardwise.observe.peak import measure_gemm_tflops
    from shardwise.ops import cpu_bf16
    from shardwise.runtime.machine import cpu_kind

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("extra", nargs="*", help="overrides for the training runs, after --")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"CPU kind {cpu_kind()}, {a.threads} threads, torch {torch.__version__}\n")
    print("| width | layout | fp32 TFLOP/s | bf16, torch's kernel | bf16 as fp32 GEMMs | ratio |")
    print("|---|---|---|---|---|---|")
    cpu = torch.device("cpu")
    for n in a.widths:
        for layout, product in (("a @ b.T (linear forward)", F.linear), ("a @ b", torch.matmul)):
            fp32 = measure_gemm_tflops(torch.float32, cpu, n, products=(product,))
            own = measure_gemm_tflops(torch.bfloat16, cpu, n, 0.5, products=(product,))
            with cpu_bf16.registered():
                ours = measure_gemm_tflops(torch.bfloat16, cpu, n, products=(product,))
            print(f"| {n} | {layout} | {fp32:.4f} | {own:.4f} | {ours:.4f} | {ours / own:.1f}x |")
    if a.train:
        bf16, fp32 = train_rate(a.steps, "bf16", a.extra), train_rate(a.steps, "fp32", a.extra)
        print(f"\ndebug, 1 rank, tokens/s: bf16 {bf16:,.0f}, fp32 {fp32:,.0f} ({bf16 / fp32:.2f}x)")


if __name__ == "__main__":
    main()
