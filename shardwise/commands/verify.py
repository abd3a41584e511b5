"""``shardwise verify``: train the 1-rank reference and each layout from one seed and compare
losses and parameters against stated tolerances."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shardwise.commands.common import add_model, add_nproc, load_resolved
from shardwise.config.outputs import check_folder
from shardwise.config.schema import ConfigError

if TYPE_CHECKING:
    from shardwise.verify.parity import Verification

NAME = "verify"
SUMMARY = "prove layouts match the 1-rank run"
DESCRIPTION = (
    "Train the 1-rank reference and each layout for the run's first --steps steps from one seed "
    "checkpoint; compare losses and final parameters against documented tolerances (in bf16, at least "
    "3x the run's own noise floor). Extra --section.key=value overrides apply to every run."
)
EXAMPLES = (
    "shardwise verify --config configs/debug.toml --nproc 4",
    "shardwise verify --config configs/debug.toml --layouts dp_shard=2 tp=2 --steps 10",
    "shardwise verify --config configs/debug.toml --ranks 64 --layouts dp_replicate=2,tp=8 --steps 2",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    add_model(p)
    add_nproc(p, "ranks of every layout: a layout without dp_shard fills it to this many; without "
                 "--layouts, verify dp_shard=N and (N even) tp=2 with dp_shard=N/2")
    p.add_argument("--layouts", nargs="+", default=None,
                   help="layouts as degree lists, e.g. dp_shard=4 tp=2,dp_shard=2 (each one's product of "
                        "degrees is its number of ranks)")
    p.add_argument("--ranks", type=int, default=None,
                   help="train each layout as this many simulated ranks in this process (torch's "
                        "LocalTensorMode) instead of as real processes: layouts of up to 1,024 ranks on one "
                        "machine; fills layouts as --nproc does (the reference stays a real 1-rank run)")
    p.add_argument("--shrink", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="narrow the model N-fold for the run (--ranks at scale): keep its blocks, heads, "
                        "vocabulary and expert and routing counts, divide its hidden widths by N (alone: "
                        "the largest power of two that divides them)")
    p.add_argument("--shrink-experts", type=int, default=1, metavar="M",
                   help="with --shrink, an MoE model's routed experts' hidden width divided M-fold more "
                        "(its experts hold most of its bytes; no layout's cut depends on that width)")
    p.add_argument("--steps", type=int, default=20,
                   help="the run's first N steps, which every layout trains on the run's own "
                        "learning-rate schedule (training.steps)")
    p.add_argument("--out", default="runs/verify", help="where runs, logs and the plot go")
    p.add_argument("--localize", action="store_true",
                   help="name where each layout first departs from the reference (module output or "
                        "gradient of step 1), not only the failing ones")
    p.add_argument("--moe-routing", default="replay", choices=["replay", "free"],
                   help="MoE models: each layout replays the reference's expert choices per token and "
                        "reports where its own router differs (default), or routes freely (a near-tie "
                        "broken the other way then fails the layout)")


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    return 0 if verification(args, overrides).passed else 1


def verification(args: argparse.Namespace, overrides: list[str]) -> Verification:
    """The checked flags' layouts verified (what :func:`run` prints, as an object)."""
    from pathlib import Path

    from shardwise.resolve.checks import load_config
    from shardwise.resolve.layouts import fill_layouts, parse_layout

    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.ranks is not None and args.nproc is not None:
        raise ConfigError("--ranks (simulated ranks) and --nproc (real ones) are two ways to run the "
                          "layouts: give one")
    if args.ranks is not None and not 1 < args.ranks <= 1024:
        raise ConfigError(f"--ranks must be 2..1024, got {args.ranks}")
    if args.shrink_experts != 1 and args.shrink is None:
        raise ConfigError("--shrink-experts narrows the experts beyond --shrink: give --shrink too")
    if args.shrink is not None:  # (before anything resolves the model: every run trains the narrow one)
        overrides = [*overrides, *_shrunk(args.config, overrides, args.shrink, args.shrink_experts)]
    if args.ranks is not None:  # (the reference too: it must train what the simulated ranks train)
        overrides = [*overrides, *_eager(args.config, overrides)]
    ranks = args.ranks or args.nproc
    flag = "--nproc" if args.ranks is None else "--ranks"
    layouts = fill_layouts(args.layouts, ranks, flag=flag)  # a bad one fails before any run (and torch)
    overrides = [*overrides, *_synthetic_default(args.config, overrides)]
    # (resolved: its precision chooses the tolerances)
    base = load_resolved(args.config, overrides)  # (its training.steps: the schedule verify follows)
    if args.layouts is None and base.model.n_experts:  # an MoE model's standard layouts add EP
        layouts = fill_layouts(None, ranks, experts=True, flag=flag)
    from shardwise.resolve.run import resolve_run

    for text in layouts:  # each layout as the trainer will check it, before the reference runs
        layout_overrides, world = parse_layout(text)
        cfg = load_config(args.config, [*overrides, *layout_overrides])
        run = resolve_run(cfg, world, detect_device=False)
        if args.ranks is not None:
            from shardwise.verify.simulated import check_simulated

            check_simulated(run)
    check_folder(args.out, "--out")
    from shardwise.verify.parity import verify_layouts

    return verify_layouts(base, args.config, overrides, layouts, args.steps, Path(args.out), args.moe_routing,
                          args.localize, simulated=args.ranks is not None)


def _shrunk(config: str | None, overrides: list[str], factor: int, experts: int) -> list[str]:
    """The model overrides of ``--shrink`` (said in a notice)."""
    from shardwise.config.notice import notice
    from shardwise.resolve.run import resolve_model
    from shardwise.verify.shrink import largest_factor, shrink

    model = resolve_model(load_resolved(config, overrides))
    added, said = shrink(model, factor or largest_factor(model), experts)
    notice(said)
    return added


def _eager(config: str | None, overrides: list[str]) -> list[str]:
    """Simulated ranks run eager and without float8: a preset's float8.enabled / compile.enabled=true
    is turned off for every run, in a notice (one the user set on the command line is refused, by
    ``check_simulated``)."""
    from shardwise.config.notice import notice
    from shardwise.config.schema import parse_overrides
    from shardwise.resolve.checks import load_config

    given, cfg = {k for k, _ in parse_overrides(overrides)}, load_config(config, overrides)
    off = [key for key, on in (("float8.enabled", cfg.float8.enabled), ("compile.enabled",
                                                                        cfg.compile.enabled is True))
           if on and key not in given]
    if off:
        notice(f"verify --ranks: {' and '.join(f'{k}=false' for k in off)} for the reference and every "
               "layout (simulated ranks run eager, without float8; verify those with real ranks, --nproc)")
    return [f"--{k}=false" for k in off]


def _synthetic_default(config: str | None, overrides: list[str]) -> list[str]:
    """A family's preset on the shipped tokenizer (no data of the user's: the Llama 3 tokenizer is
    not on this machine) verifies on ``data.synthetic``'s random ids over its whole vocabulary, in a
    notice: verify compares layouts, which any ids over every row exercise. Data the user named is
    never replaced (its tokenizer is checked as training checks it)."""
    from shardwise.resolve.checks import load_config

    cfg = load_config(config, overrides)  # (a bad value is refused here, before torch is imported)
    d = cfg.data
    if d.synthetic or d.path or d.sources or d.val_path or d.tokenizer or d.format == "chat":
        return []
    from shardwise.config.notice import notice
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.resolve.preflight import needs_own_tokenizer
    from shardwise.resolve.run import resolve_model

    args = resolve_model(cfg)
    tokens = load_tokenizer("").vocab_size
    if not needs_own_tokenizer(cfg, args, tokens):
        return []
    notice(f"verify: model {cfg.model.name or 'custom'} trains with its own tokenizer of {args.vocab_size:,} "
           f"ids, not the shipped one's {tokens:,}: every run verifies on data.synthetic's random ids over "
           "all of them (--data.tokenizer DIR verifies on the corpus instead)")
    return ["--data.synthetic=true"]
