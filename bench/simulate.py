"""Time and memory of simulated ranks (``verify --ranks``): the debug preset trained as N simulated
ranks in one process, TP 8 x FSDP N/8 (one sequence per data-parallel rank), one fresh process per
N so each peak RSS is that size's own.

    python bench/simulate.py                      # N = 64, 256, 512; sequences of 128 tokens
    python bench/simulate.py --ranks 64 --seq 512

Each row: the build (mesh, model meta -> parallelize -> materialize -> init, loaders), each step's
wall time (the first pays FSDP's lazy initialization), the process's peak RSS, and the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(ranks: int, seq: int, steps: int) -> dict:
    """One size in this process: its figures."""
    from shardwise.models.transformer import build_model, init_weights
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.run import resolve_model
    from shardwise.verify.simulated import train_simulated

    tp, dp = 8, ranks // 8
    cfg = load_config(ROOT / "configs" / "debug.toml", [
        f"--parallel.tp={tp}", f"--parallel.dp_shard={dp}", f"--training.global_batch={dp}",
        "--training.micro_batch=1", f"--training.seq_len={seq}", "--training.mixed_precision=fp32",
        "--debug.deterministic=true", "--eval.interval=0"])
    model = build_model(resolve_model(cfg), device="cpu")
    init_weights(model, cfg.training.seed)
    seed = {k: v.detach() for k, v in model.state_dict().items()}
    del model
    t0 = time.perf_counter()
    sim = train_simulated(cfg, ranks, steps, seed, seed)
    total = time.perf_counter() - t0
    return {"ranks": ranks, "layout": f"tp={tp},dp_shard={dp}", "seq": seq, "steps_s": sim.step_seconds,
            "build_s": total - sum(sim.step_seconds), "peak_rss_gib": sim.peak_rss_gib,
            "loss": sim.losses[-1][0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a row's own process)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.ranks[0], args.seq, args.steps)))
        return
    from shardwise.observe.peak import cpu_name

    print(f"machine: {cpu_name()}")
    for n in args.ranks:
        out = subprocess.run([sys.executable, __file__, "--one", "--ranks", str(n), "--seq", str(args.seq),
                              "--steps", str(args.steps)], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            print(f"{n} ranks failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        steps = ", ".join(f"{s:.1f}" for s in row["steps_s"])
        print(f"{row['ranks']:>4} ranks ({row['layout']}, seq {row['seq']}): build {row['build_s']:.1f} s, "
              f"steps {steps} s, peak RSS {row['peak_rss_gib']:.2f} GiB, loss {row['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
