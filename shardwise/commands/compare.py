"""``shardwise compare``: where two run traces first differ."""

from __future__ import annotations

import argparse

from shardwise.config.schema import ConfigError

NAME = "compare"
SUMMARY = "where two run traces first differ"
DESCRIPTION = (
    "Compare two traces written by train --debug.trace FILE (every rank's file): say they are bitwise "
    "equal, or name the first step and module output (or gradient) where they differ, with both norms "
    "and the last signature that agreed. Exit 0 when they agree, 1 when they differ."
)
EXAMPLES = (
    "shardwise compare runs/a.trace runs/b.trace",
    "shardwise compare runs/a.trace runs/b.trace --rtol 1e-6",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="a trace file (rank 0's; the FILE.rankN files beside it are compared too)")
    p.add_argument("b", help="the trace to compare it with")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="differ only where a norm differs by more than this, relative (0: any bit)")


def run(args: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    from pathlib import Path

    from shardwise.observe.trace import compare

    if extra:
        raise ConfigError(f"compare takes two trace files and --rtol only, got {' '.join(extra)}")
    if args.rtol < 0:
        raise ConfigError(f"--rtol {args.rtol} must be >= 0 (0: bitwise)")
    same, report = compare(Path(args.a), Path(args.b), args.rtol)
    print(report)
    return 0 if same else 1
