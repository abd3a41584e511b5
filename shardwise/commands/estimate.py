"""``shardwise estimate``: per-rank memory, communication and step time of one layout."""

from __future__ import annotations

import argparse

from shardwise.commands.common import (
    add_model,
    add_nproc,
    add_overwrite,
    load_resolved,
    need_nproc,
    refuse_lora_costing,
)
from shardwise.config import extras
from shardwise.config.outputs import target

NAME = "estimate"
SUMMARY = "per-rank memory, communication and step time of a layout"
DESCRIPTION = (
    "Predict, without the cluster, what one layout costs per rank: parameters, gradients and optimizer "
    "states (exact: the real model built and parallelized on torch's fake process group), activations "
    "and the step's peak memory, every collective with its bytes, and the step time on a hardware "
    "profile. Overrides --section.key=value apply as in train."
)
EXAMPLES = (
    "shardwise estimate --model 8b --nproc 8 --parallel.tp 2",
    "shardwise estimate --config plan.toml --nproc 64 --json estimate.json",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    add_model(p)
    add_nproc(p, "number of ranks (devices), required")
    p.add_argument("--hardware", default="h100",
                   help="h100, h200, a100, b200, mi300x, local (after `shardwise calibrate`) or a .toml")
    p.add_argument("--json", default="", help="also write the estimate as JSON to this file")
    add_overwrite(p, "--json")


def estimation(args: argparse.Namespace, overrides: list[str]):  # noqa: ANN201 - plan.estimate.Estimate
    """The estimate of ``args``' layout (its one-line notices said), as :func:`run` prints it and
    ``shardwise.estimate`` returns it."""
    from shardwise.config.notice import notice
    from shardwise.plan.hardware import load_hardware, profile_device

    world = need_nproc(args, "ranks (devices) to estimate for")
    # training.mixed_precision=auto resolves for the planned device, not for this machine.
    cfg = load_resolved(args.config, overrides, profile_device(args.hardware))
    refuse_lora_costing(cfg, "estimate")
    from shardwise.resolve.run import resolve_run

    # The trainer's own refusals, one line each (for the planned machine, not this one's device);
    # the run they resolve is the one estimated.
    run = resolve_run(cfg, world, detect_device=False)
    if said := extras.plan_without_float8(cfg):
        notice(said)
    hw = load_hardware(args.hardware, cfg.data.cache_dir)
    from shardwise.plan.estimate import estimate_run

    return estimate_run(run, hw)


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    where = target(args.json, "--json", args.overwrite, folder=False) if args.json else None
    est = estimation(args, overrides)
    from shardwise.plan.estimate import estimate_json, format_estimate  # (torch: after the checks)

    print(format_estimate(est))
    if where is not None:
        where.write(estimate_json(est))
    return 0
