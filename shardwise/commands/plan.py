"""``shardwise plan``: rank the layouts of a model on a cluster and write the best as a config."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.commands.common import (
    add_model,
    add_nproc,
    add_overwrite,
    load_resolved,
    need_nproc,
    refuse_lora_costing,
)
from shardwise.config import extras
from shardwise.config import schema as config
from shardwise.config.outputs import target
from shardwise.config.schema import Config, ConfigError

if TYPE_CHECKING:
    from shardwise.plan.estimate import Estimate
    from shardwise.plan.hardware import Hardware
    from shardwise.plan.search import PlanResult

NAME = "plan"
SUMMARY = "rank the layouts of a model on a cluster"
DESCRIPTION = (
    "Enumerate layouts (pp, dp_replicate, dp_shard, cp, tp, ep, pipeline schedule, micro-batch, "
    "activation checkpointing), drop those the trainer would refuse or that do not fit in memory, rank "
    "the rest by predicted tokens/s per device, print the best and write the first as a ready-to-run "
    "config. Overrides --section.key=value (e.g. --float8.enabled true) apply to every candidate."
)
EXAMPLES = (
    "shardwise plan --model 8b --nproc 8",
    "shardwise plan --model 70b --nproc 256 --hardware h200 --global-batch-tokens 4M",
)
OWN_MODEL_NOTICE = True
"""plan writes the --model notice into the config it writes, and says it after the table."""

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML giving everything but the layout (default: built-in defaults)")
    add_model(p)
    add_nproc(p, "number of devices (ranks), required")
    p.add_argument("--hardware", default="h100", help="hardware profile (see estimate)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's)")
    p.add_argument("--global-batch-tokens", default="",
                   help="tokens per optimizer step, e.g. 4M (default: one sequence of --seq tokens per "
                        "device, and at least the config's training.global_batch, which counts sequences)")
    p.add_argument("--top", type=int, default=5, help="layouts to show (each estimated exactly)")
    p.add_argument("--ac", default="none,selective,selective_half,full",
                   help="activation-checkpointing modes to try")
    p.add_argument("--schedules", default="1f1b,interleaved1f1b,zbv", help="pipeline schedules to try")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="usable fraction of device memory (allocator fragmentation, CUDA context)")
    p.add_argument("--out", default=None, help="where the best layout's config is written (default: "
                   "plan.toml, an earlier one kept aside; '' = not written)")
    add_overwrite(p, "--out")
    p.add_argument("--verify", action="store_true",
                   help="before writing it, train the first choice as --nproc simulated ranks against "
                        "one rank (verify --ranks, the model narrowed by --shrink, fp32, 2 steps of 64-token "
                        "sequences): a layout that fails is not written")


@dataclass
class Planning:
    """A plan's question, checked and resolved: the config every candidate shares, the cluster, and
    the search's bounds. ``search()`` answers it (the CLI prints the answer; shardwise.plan returns it)."""

    cfg: Config
    hw: Hardware
    gpus: int
    top: int
    memory_fraction: float
    ac: tuple[str, ...]
    schedules: tuple[str, ...]
    batch_from_gpus: bool
    """No --global-batch-tokens: the batch followed the device count (said when nothing fits)."""
    notes: tuple[str, ...]

    def search(self) -> PlanResult:
        from shardwise.plan.search import plan

        return plan(self.cfg, self.gpus, self.hw, self.top, self.memory_fraction, self.ac, self.schedules)

    def table(self, result: PlanResult) -> str:
        from shardwise.plan.search import format_plan

        return format_plan(result, self.cfg, self.gpus, self.hw)

    def why_nothing(self, result: PlanResult) -> str:
        from shardwise.plan.search import why_nothing

        return why_nothing(result, self.cfg, self.gpus, self.hw, self.memory_fraction, self.batch_from_gpus)


def checked_planning(args: argparse.Namespace, overrides: list[str]) -> Planning:
    """The flags checked and the config resolved once, before any search (one-line errors)."""
    from shardwise.plan.hardware import load_hardware, profile_device

    gpus = need_nproc(args, "devices to plan for")
    if getattr(args, "verify", False) and gpus < 2:
        raise ConfigError("--verify trains the plan's layout as simulated ranks: it needs --nproc 2 or more")
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    if not 0 < args.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    ac = tuple(filter(None, args.ac.split(",")))
    schedules = tuple(filter(None, args.schedules.split(",")))
    for name, values, key in (("--ac", ac, "activation_checkpoint.mode"),
                              ("--schedules", schedules, "parallel.pp_schedule")):
        if bad := [v for v in values if v not in config.choices(key)]:
            known = ", ".join(config.choices(key))
            raise ConfigError(f"{name}: unknown {', '.join(bad)}; choose from {known}")
    cfg = load_resolved(args.config, overrides, profile_device(args.hardware))
    refuse_lora_costing(cfg, "plan")
    without_float8 = extras.plan_without_float8(cfg)
    hw = load_hardware(args.hardware, cfg.data.cache_dir)
    from shardwise.plan.search import (  # (torch: checks first)
        data_note,
        parse_tokens,
        plan_config,
        shape_differs,
    )

    seq = args.seq or cfg.training.seq_len
    tokens = (parse_tokens(args.global_batch_tokens) if args.global_batch_tokens
              else max(cfg.training.global_batch, gpus) * seq)
    cfg = plan_config(cfg, seq, tokens)
    notes = tuple(n for n in (args.model_note, without_float8, shape_differs(cfg), data_note(cfg)) if n)
    return Planning(cfg, hw, gpus, args.top, args.memory_fraction, ac, schedules,
                    not args.global_batch_tokens, notes)


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    import time

    from shardwise.config.notice import notice

    planning = checked_planning(args, overrides)
    default_out = args.out is None
    args.out = "plan.toml" if default_out else args.out
    where = (target(args.out, "--out", args.overwrite, default=default_out, folder=False, example="plan.toml")
             if args.out else None)
    start = time.perf_counter()
    result = planning.search()
    print(planning.table(result))
    print(f"({time.perf_counter() - start:.1f} s)")
    if not result.top:
        print(planning.why_nothing(result), file=sys.stderr)
        return 1
    from shardwise.plan.search import layout_toml, run_command

    if args.verify and not verified(result.top[0], verify_folder(args.out)):
        print("plan --verify: the best layout failed its simulated verify (above); no plan written",
              file=sys.stderr)
        return 1
    if args.out:
        if said := where.write(layout_toml(result.top[0], args.out, planning.notes)):
            notice(said)
        print(f"best layout written to {args.out}: {run_command(args.out, planning.gpus, planning.hw)}")
    for n in planning.notes:
        notice(n)
    return 0


VERIFY_SETTINGS = ("--shrink", "--steps", "2", "--training.mixed_precision=fp32", "--training.seq_len=64",
                   "--run.device=cpu")
"""How ``plan --verify`` checks a layout: narrowed, in fp32 (verify's proof), briefly, on short
sequences (the layout's cut does not depend on their length; the planned ones would take hours),
on this machine's CPU whatever the hardware planned for (simulated ranks are one process's)."""


def verify_folder(out: str) -> Path:
    """Where ``plan --verify`` keeps its verify runs: beside the plan (``plan.toml`` ->
    ``plan-verify/``), or ``runs/plan-verify`` when none is written."""
    return Path(out).with_name(Path(out).stem + "-verify") if out else Path("runs") / "plan-verify"


def verified(est: Estimate, folder: Path) -> bool:
    """Whether ``est``'s layout passes ``shardwise verify --ranks`` (its own config, written into
    ``folder`` as ``layout.toml``, with verify's runs): verify's report is printed as it runs."""
    import subprocess

    from shardwise.parallel.dims import DEGREES
    from shardwise.plan.search import layout_toml

    par = est.cfg.parallel
    layout = ",".join(f"{k}={getattr(par, k)}" for k in DEGREES if getattr(par, k) > 1)
    print(f"plan --verify: {layout} as {est.layout.world} simulated ranks ...", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "layout.toml"
    path.write_text(layout_toml(est, str(path)))
    cmd = [sys.executable, "-m", "shardwise", "verify", "--config", str(path), "--ranks",
           str(est.layout.world), "--layouts", layout, *VERIFY_SETTINGS, "--out", str(folder / "runs")]
    return subprocess.run(cmd).returncode == 0
