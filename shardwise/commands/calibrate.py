"""``shardwise calibrate``: measure this machine for ``--hardware local``."""

from __future__ import annotations

import argparse

NAME = "calibrate"
SUMMARY = "measure this machine for --hardware local"
DESCRIPTION = (
    "Measure GEMM and attention throughput per dtype and thread count, memory bandwidth, gloo "
    "collective bandwidth and latency among local processes, and the host overhead of a step; save them "
    "as the 'local' hardware profile (two to five minutes on 2 cores; --quick, about 40 s)."
)
EXAMPLES = (
    "shardwise calibrate --quick",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and shorter timings (about 40 s on 2 cores; noisier)")


def run(args: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    from shardwise.plan.calibrate import calibrate
    from shardwise.plan.hardware import local_path
    from shardwise.resolve.checks import load_config

    cfg = load_config(None, extra)
    print("calibrating this machine ...", flush=True)
    calibrate(cfg.data.cache_dir, quick=args.quick)
    print(f"saved {local_path(cfg.data.cache_dir)}: use --hardware local")
    return 0
