"""``shardwise report``: an HTML page and PNGs of one or more runs."""

from __future__ import annotations

import argparse

from shardwise.commands.common import add_overwrite
from shardwise.config.outputs import target
from shardwise.config.schema import ConfigError

NAME = "report"
SUMMARY = "HTML + PNG report of one or more runs"
DESCRIPTION = (
    "Write a self-contained HTML page and PNGs (loss, lr, grad norm, tokens/s, MFU, memory and step "
    "time per rank) for the given run directories, overlaid for comparison."
)
EXAMPLES = (
    "shardwise report runs/debug",
    "shardwise report runs/a runs/b --out runs/compare",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default="", help="output folder (default: RUN_DIR/report for one run, "
                                             "runs/report for several)")
    p.add_argument("--screenshot", action="store_true",
                   help="also render the page in headless Chromium to report.png")
    add_overwrite(p, "--out")


def run(args: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    from pathlib import Path

    from shardwise.observe.report import screenshot, write_report

    if extra:
        raise ConfigError(f"report takes run directories and --out only, got {' '.join(extra)}")
    for d in args.runs:
        if not (Path(d) / "metrics.jsonl").is_file():
            raise ConfigError(f"'{d}' has no metrics.jsonl: pass a run directory (run.dir of a training run)")
    out = Path(args.out) if args.out else (Path(args.runs[0]) / "report" if len(args.runs) == 1
                                           else Path("runs/report"))
    with target(out, "--out", args.overwrite, default=not args.out).staging() as staging:
        page = write_report([Path(d) for d in args.runs], staging)
        if args.screenshot:
            try:
                shot = screenshot(page, staging / "report.png")
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
    print(f"report: {out / page.name}")
    if args.screenshot:
        print(f"screenshot: {out / shot.name}")
    return 0
