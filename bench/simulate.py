"""Time and memory of simulated ranks (``verify --ranks``): the debug preset trained as N simulated
ranks in one process, TP 8 x FSDP N/8 (one sequence per data-parallel rank), one fresh process per
N so each peak RSS is that size's own.

    python bench/simulate.py                      # N = 64, 256, 512; sequences of 128 tokens
    python bench/simulate.py --ranks 64 --seq 512
    # Llama 3 405B narrowed as `verify --shrink` narrows it, 16 of its blocks, PP 8 x TP 8:
    python bench/simulate.py --config configs/405b.toml --shrink --pp 8 --layers 16 --ranks 64 \
        --seq 64 --batch 8

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


def one(args: argparse.Namespace) -> dict:
    """One size in this process: its figures."""
    from shardwise.models.transformer import build_model, init_weights
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.run import resolve_model
    from shardwise.verify.shrink import largest_factor, shrink
    from shardwise.verify.simulated import train_simulated

    ranks, seq, steps = args.ranks[0], args.seq, args.steps
    tp, pp = 8, args.pp
    dp = ranks // (tp * pp)
    over = [f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.dp_shard={dp}",
            f"--training.global_batch={args.batch or dp}", "--training.micro_batch=1",
            f"--training.seq_len={seq}", "--training.mixed_precision=fp32", "--debug.deterministic=true",
            "--eval.interval=0", "--compile.enabled=false", "--float8.enabled=false",
            *([f"--model.n_layers={args.layers}"] if args.layers else [])]
    cfg = load_config(args.config, over)
    if args.shrink:  # (the widths divided as `verify --shrink` divides them)
        model_args = resolve_model(cfg)
        cfg = load_config(args.config, over + shrink(model_args, largest_factor(model_args))[0])
    model = build_model(resolve_model(cfg), device="cpu")
    init_weights(model, cfg.training.seed)
    seed = {k: v.detach() for k, v in model.state_dict().items()}
    del model
    t0 = time.perf_counter()
    sim = train_simulated(cfg, ranks, steps, seed, seed)
    total = time.perf_counter() - t0
    layout = f"pp={pp},tp={tp},dp_shard={dp}" if pp > 1 else f"tp={tp},dp_shard={dp}"
    return {"ranks": ranks, "layout": layout, "seq": seq, "steps_s": sim.step_seconds,
            "build_s": total - sum(sim.step_seconds), "peak_rss_gib": sim.peak_rss_gib,
            "loss": sim.losses[-1][0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--config", default=str(ROOT / "configs" / "debug.toml"))
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks (TP 8 x PP x FSDP the rest)")
    p.add_argument("--layers", type=int, default=0, help="blocks to keep (default: the preset's)")
    p.add_argument("--batch", type=int, default=0, help="global batch (default: one per data-parallel rank)")
    p.add_argument("--shrink", action="store_true", help="narrow the widths as verify --shrink does")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a row's own process)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    from shardwise.observe.peak import cpu_name

    print(f"machine: {cpu_name()}")
    for n in args.ranks:
        own = ["--config", args.config, "--pp", str(args.pp), "--layers", str(args.layers),
               "--batch", str(args.batch), *(["--shrink"] if args.shrink else [])]
        out = subprocess.run([sys.executable, __file__, "--one", "--ranks", str(n), "--seq", str(args.seq),
                              "--steps", str(args.steps), *own], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            print(f"{n} ranks failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        steps = ", ".join(f"{s:.1f}" for s in row["steps_s"])
        print(f"{row['ranks']:>4} ranks ({row['layout']}, seq {row['seq']}): build {row['build_s']:.1f} s, "
              f"steps {steps} s, peak RSS {row['peak_rss_gib']:.2f} GiB, loss {row['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
