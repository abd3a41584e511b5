"""``shardwise`` command line: thin wrappers over the library.

``shardwise train --nproc N`` validates the config for N ranks, prepares the data once, then starts
N ranks through torch's elastic launcher (``torch.distributed.run``, the code behind ``torchrun``,
on loopback; shardwise/launch.py). Each rank re-enters this same command with WORLD_SIZE set, which
is also exactly what happens under an external ``torchrun`` or a Slurm ``srun torchrun`` on many nodes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
import textwrap
import traceback

from shardwise import config, flags, process
from shardwise.config import Config, ConfigError


def load_config(path: str | None, overrides: list[str], device: str | None = None) -> Config:
    """:func:`shardwise.config_checks.load_config`, imported on first use: the checks load the
    models and torch, which ``shardwise --help`` and a mistyped subcommand never need."""
    from shardwise.config_checks import load_config as load

    return load(path, overrides, device)


def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written under it in the source (for the
    ``[model]`` section, derived from ModelArgs, that class's source and the preset name's doc)."""
    if hasattr(cls, "docs_from"):
        return {"name": cls.name_doc, **field_docs(cls.docs_from)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def help_text() -> str:
    """Every config key with its type, default and docstring."""
    lines = []
    defaults = config.Config()
    for section, cls in config.sections().items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for name, tp in config.section_fields(cls).items():
            default = getattr(getattr(defaults, section), name)
            shown = "(preset)" if default is None else config.toml_value(default)
            lines.append(f"  --{section}.{name}  ({config.type_name(tp)}, default {shown})")
            lines.append("      " + " ".join(docs.get(name, "").split()))
    return "\n".join(lines)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model", allow_abbrev=False,
                       description="Train a model. Any config key can be overridden with "
                                   "--section.key=value (see --help-config).")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml (default: built-in defaults)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch this many local ranks (not under torchrun, which sets the world)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart all ranks this many times after a rank fails")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")


def cmd_train(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from pathlib import Path

    from shardwise.device import launched_world_size

    if args.help_config:
        print(help_text())
        return 0
    if (args.nproc or 0) > 1 and not args.print_config and launched_world_size() is None:
        # The ranks' imports start now, beside this launcher's own and its config checks.
        process.start_rank_server(args.nproc, args.max_restarts)
    from shardwise.rundir import LOCK_ENV, take

    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    world = launched_world_size()
    if world is not None and (args.nproc is not None or args.max_restarts):
        raise ConfigError("--nproc/--max-restarts cannot be used under torchrun: the launcher already "
                          "sets them (use its --nproc-per-node / --max-restarts)")
    nproc = args.nproc if args.nproc is not None else (world or 1)
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    from shardwise.preflight import preflight

    dims = preflight(cfg, nproc)  # all config errors surface here, before any process group exists
    if world is not None or nproc == 1:
        # The trainer's modules are imported only where it runs: the launcher of --nproc ranks
        # starts them a second sooner without torch._dynamo, which the trainer's import brings.
        from shardwise.train import train
    if world is not None:  # a rank (of this launcher, torchrun or Slurm)
        train(cfg, dims)
        return 0
    # This process holds run.dir for the whole run, its ranks and their restarts included.
    lock = take(Path(cfg.run.dir))
    os.environ[LOCK_ENV] = str(lock.path.absolute())
    try:
        if nproc == 1:
            train(cfg, dims)
            return 0
        from shardwise.data.prepare import prepare
        from shardwise.data.tokenizer import load_tokenizer

        prepare(cfg.data, load_tokenizer(cfg.data.tokenizer))  # once, here; the ranks memory-map it
        from shardwise.launch import launch, strip_launcher_flags

        return launch(strip_launcher_flags(argv), nproc, args.max_restarts, cfg.run.dir, rank_main)
    finally:
        os.environ.pop(LOCK_ENV, None)
        lock.release()


def _verify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove layouts match the 1-rank run", allow_abbrev=False,
                       description="Train the 1-rank reference and each layout for --steps steps from "
                                   "one seed checkpoint; compare losses and final parameters against "
                                   "documented tolerances. Extra --section.key=value overrides apply "
                                   "to every run.")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    p.add_argument("--layouts", nargs="+", required=True,
                   help="layouts as degree lists, e.g. dp_shard=4 tp=2,dp_shard=2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="runs/verify", help="where runs, logs and the plot go")
    p.add_argument("--moe-routing", default="replay", choices=["replay", "free"],
                   help="MoE models: each layout replays the reference's expert choices per token and "
                        "reports where its own router differs (default), or routes freely (a near-tie "
                        "broken the other way then fails the layout)")


def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from shardwise.verify import verify

    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    return 0 if verify(args.config, overrides, args.layouts, args.steps, Path(args.out),
                       args.moe_routing) else 1


def _report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="HTML + PNG report of one or more runs", allow_abbrev=False,
                       description="Write a self-contained HTML page and PNGs (loss, lr, grad norm, "
                                   "tokens/s, MFU, memory and step time per rank) for the given run "
                                   "directories, overlaid for comparison.")
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default="", help="output folder (default: RUN_DIR/report for one run, "
                                             "runs/report for several)")
    p.add_argument("--screenshot", action="store_true",
                   help="also render the page in headless Chromium to report.png")


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from pathlib import Path

    from shardwise.observe.report import screenshot, write_report

    if extra:
        raise ConfigError(f"report takes run directories and --out only, got {' '.join(extra)}")
    for d in args.runs:
        if not (Path(d) / "metrics.jsonl").is_file():
            raise ConfigError(f"'{d}' has no metrics.jsonl: pass a run directory (run.dir of a training run)")
    out = Path(args.out) if args.out else (Path(args.runs[0]) / "report" if len(args.runs) == 1
                                           else Path("runs/report"))
    page = write_report([Path(d) for d in args.runs], out)
    print(f"report: {page}")
    if args.screenshot:
        try:
            print(f"screenshot: {screenshot(page, out / 'report.png')}")
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
    return 0


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="HF safetensors <-> shardwise checkpoint", allow_abbrev=False,
                       description="Export a checkpoint to a Hugging Face folder (config.json + "
                                   "safetensors; Llama, Qwen3 or Qwen3-MoE by the model's shape), or "
                                   "import one as a weights-only checkpoint to start training from. "
                                   "Import reads the model shape from the folder's config.json and "
                                   "writes a training config for it (--toml); with --config (and "
                                   "--model.* overrides) it checks the HF config against that model.")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-hf", metavar="CHECKPOINT", help="a step-<N> checkpoint directory to export")
    way.add_argument("--from-hf", metavar="HF_DIR", help="an HF model folder to import")
    p.add_argument("--out", required=True, help="output folder (HF folder, or the new checkpoint)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="export dtype")
    p.add_argument("--config", help="TOML config: its other sections go into the written config "
                                    "(import only); with model fields, they must match config.json")
    p.add_argument("--toml", help="import: the training config to write (default: <out>.toml)")


def cmd_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from shardwise import convert

    if args.to_hf:
        if overrides or args.config or args.toml:
            raise ConfigError("convert --to-hf reads the model config from the checkpoint's manifest: "
                              "drop --config, --toml and overrides")
        files = convert.export_hf(Path(args.to_hf), Path(args.out), args.dtype)
        print(f"exported {args.to_hf} -> {args.out} ({len(files)} safetensors file(s), {args.dtype})")
        return 0
    out = Path(args.out)
    toml = Path(args.toml or f"{out}.toml")
    if toml.exists():
        raise ConfigError(f"{toml} exists and is not replaced: pass --toml with a new path")
    cfg = load_config(args.config, overrides)
    # The model comes from config.json unless the user named one (a preset or model fields).
    from shardwise.config_types import read_toml
    from shardwise.hf_config import hf_tokenizer

    named = bool(args.config and "model" in read_toml(Path(args.config), "config file")) or any(
        o.startswith("--model.") for o in overrides)
    out, model = convert.import_hf(Path(args.from_hf), out, cfg.model if named else None)
    cfg.model = model
    cfg.checkpoint.path = str(out)
    cfg.data.tokenizer = cfg.data.tokenizer or hf_tokenizer(Path(args.from_hf))  # the model's own
    # The config trains elsewhere too: keep `auto` precision for the machine that trains, not this one's.
    cfg.training.mixed_precision = config.read_config(args.config, overrides).training.mixed_precision
    toml.write_text(cfg.to_toml())
    print(f"imported {args.from_hf} -> {out} (model {model.name or 'from config.json'}); train from it: "
          f"shardwise train --config {toml}")
    return 0


def _prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize the data into memory-mapped shards", allow_abbrev=False,
                       description="Stream data.path (or each of data.sources, and data.val_path), "
                                   "tokenize it on every core and write the token shards training "
                                   "memory-maps, into data.prepared_dir (or the cache). Run it on a CPU "
                                   "node before a GPU job; an interrupted run resumes from the shards "
                                   "it finished. Extra --section.key=value overrides apply.")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")


def cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from shardwise.data.prepare import prepare
    from shardwise.data.tokenizer import load_tokenizer

    cfg = load_config(args.config, overrides)
    for where in prepare(cfg.data, load_tokenizer(cfg.data.tokenizer)):
        m = json.loads((where / "manifest.json").read_text())
        bad = f", {m['bad_rows']:,} bad rows skipped" if m["bad_rows"] else ""
        print(f"{where}: {m['shards']} shard(s), {m['docs']:,} documents and {m['tokens']:,} tokens to "
              f"train on, {m['val_docs']:,} documents and {m['val_tokens']:,} tokens held out{bad}")
    return 0


def _estimate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="per-rank memory, communication and step time of a layout",
                       allow_abbrev=False,
                       description="Predict, without the cluster, what one layout costs per rank: "
                                   "parameters, gradients and optimizer states (exact: the real model "
                                   "built and parallelized on torch's fake process group), activations "
                                   "and the step's peak memory, every collective with its bytes, and "
                                   "the step time on a hardware profile. Overrides --section.key=value "
                                   "apply as in train.")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    p.add_argument("--world", type=int, required=True, help="number of ranks (devices)")
    p.add_argument("--hardware", default="h100",
                   help="h100, h200, a100, b200, mi300x, local (after `shardwise calibrate`) or a .toml")
    p.add_argument("--json", default="", help="also write the estimate as JSON to this file")


def cmd_estimate(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardwise.plan.estimate import estimate, estimate_json, format_estimate
    from shardwise.plan.hardware import load_hardware, profile_device
    from shardwise.resolve import resolve_run

    if args.world < 1:
        raise ConfigError(f"--world must be >= 1, got {args.world}")
    # training.mixed_precision=auto resolves for the planned device, not for this machine.
    cfg = load_config(args.config, overrides, device=profile_device(args.hardware))
    # The trainer's own refusals, one line each (for the planned machine, not this one's device).
    resolve_run(cfg, args.world, detect_device=False)
    hw = load_hardware(args.hardware, cfg.data.cache_dir)
    est = estimate(cfg, args.world, hw)
    print(format_estimate(est))
    if args.json:
        estimate_json(est, args.json)
    return 0


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="rank the layouts of a model on a cluster", allow_abbrev=False,
                       description="Enumerate layouts (pp, dp_replicate, dp_shard, cp, tp, ep, pipeline "
                                   "schedule, micro-batch, activation checkpointing), drop those the "
                                   "trainer would refuse or that do not fit in memory, rank the rest by "
                                   "predicted tokens/s per device, print the best and write the first "
                                   "as a ready-to-run config. Overrides --section.key=value (e.g. "
                                   "--float8.enabled true) apply to every candidate.")
    p.add_argument("--config", help="TOML giving everything but the layout (default: built-in defaults)")
    p.add_argument("--model", default="", help="model preset (overrides the config's model.name)")
    p.add_argument("--gpus", type=int, required=True, help="number of devices")
    p.add_argument("--hardware", default="h100", help="hardware profile (see estimate)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's)")
    p.add_argument("--global-batch-tokens", default="",
                   help="tokens per optimizer step, e.g. 4M (default: one sequence of --seq tokens per "
                        "device, and at least the config's training.global_batch sequences)")
    p.add_argument("--top", type=int, default=5, help="layouts to show (each estimated exactly)")
    p.add_argument("--ac", default="none,selective,selective_half,full",
                   help="activation-checkpointing modes to try")
    p.add_argument("--schedules", default="1f1b,interleaved1f1b,zbv", help="pipeline schedules to try")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="usable fraction of device memory (allocator fragmentation, CUDA context)")
    p.add_argument("--out", default="plan.toml", help="where the best layout's config is written ('' = not)")


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import time

    from shardwise.config_checks import notice
    from shardwise.plan.hardware import load_hardware, profile_device
    from shardwise.plan.search import (
        data_note,
        format_plan,
        layout_toml,
        parse_tokens,
        plan,
        plan_base,
        plan_config,
        run_command,
        shape_differs,
        why_nothing,
    )

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if not 0 < args.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    ac = tuple(filter(None, args.ac.split(",")))
    schedules = tuple(filter(None, args.schedules.split(",")))
    for name, values, key in (("--ac", ac, "activation_checkpoint.mode"),
                              ("--schedules", schedules, "parallel.pp_schedule")):
        if bad := [v for v in values if v not in config.choices(key)]:
            known = ", ".join(config.choices(key))
            raise ConfigError(f"{name}: unknown {', '.join(bad)}; choose from {known}")
    model = [f"--model.name={args.model}"] if args.model else []
    base, said = plan_base(args.model, args.config)
    cfg = load_config(base, model + overrides, device=profile_device(args.hardware))
    hw = load_hardware(args.hardware, cfg.data.cache_dir)
    seq = args.seq or cfg.training.seq_len
    tokens = (parse_tokens(args.global_batch_tokens) if args.global_batch_tokens
              else max(cfg.training.global_batch, args.gpus) * seq)
    cfg = plan_config(cfg, seq, tokens)
    notes = [n for n in (said, shape_differs(cfg), data_note(cfg)) if n]
    start = time.perf_counter()
    result = plan(cfg, args.gpus, hw, args.top, args.memory_fraction, ac, schedules)
    print(format_plan(result, cfg, args.gpus, hw))
    print(f"({time.perf_counter() - start:.1f} s)")
    if not result.top:
        print(why_nothing(result, cfg, args.gpus, hw, args.memory_fraction, not args.global_batch_tokens),
              file=sys.stderr)
        return 1
    if args.out:
        from pathlib import Path

        from shardwise.rundir import keep_aside

        if kept := keep_aside(Path(args.out)):
            notice(f"the earlier {args.out} is kept as {kept}")
        Path(args.out).write_text(layout_toml(result.top[0], args.out, tuple(notes)))
        print(f"best layout written to {args.out}: {run_command(args.out, args.gpus, hw)}")
    for n in notes:
        notice(n)
    return 0


def _calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine for --hardware local", allow_abbrev=False,
                   description="Measure GEMM and attention throughput per dtype and thread count, "
                               "memory bandwidth, gloo collective bandwidth and latency among local "
                               "processes, and the host overhead of a step; save them as the 'local' "
                               "hardware profile (two to five minutes on 2 cores; --quick, about 40 s).")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and shorter timings (about 40 s on 2 cores; noisier)")


def cmd_calibrate(args: argparse.Namespace, extra: list[str]) -> int:
    from shardwise.plan.calibrate import calibrate
    from shardwise.plan.hardware import local_path

    cfg = load_config(None, extra)
    print("calibrating this machine ...", flush=True)
    calibrate(cfg.data.cache_dir, quick=args.quick)
    print(f"saved {local_path(cfg.data.cache_dir)}: use --hardware local")
    return 0


def rank_main(env: dict[str, str | None], *argv: str) -> None:
    """A rank of ``shardwise train --nproc N``, forked from the rank server (shardwise/process.py):
    the command the launcher ran, with the launcher's environment as it is now (``env``: what changed
    since the server started), exactly as under torchrun. Returns on success (the elastic agent then
    collects every rank's return, and the rank exits a second later); otherwise exits with the
    command's code."""
    process.enter_rank(env)
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exit
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, exit 1
        traceback.print_exc()
        code = 1
    if code:
        process.quick_exit(code)
    process.finish()
    process.exit_after_return()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="shardwise", allow_abbrev=False,
                                     description="PyTorch-native N-D parallel LLM training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _verify_parser(sub)
    _report_parser(sub)
    _convert_parser(sub)
    _prepare_parser(sub)
    _estimate_parser(sub)
    _plan_parser(sub)
    _calibrate_parser(sub)
    flags.generate_parser(sub)
    flags.eval_parser(sub)
    parser.add_argument("--version", action="version", version=flags.version())
    try:
        flags.check_command(argv, sub.choices)
        args, rest = parser.parse_known_args(argv)
        flags.check_unknown_flags(sub.choices[args.command], rest)
        if args.command == "train":
            return cmd_train(args, rest, argv)
        if args.command == "verify":
            return cmd_verify(args, rest)
        if args.command == "report":
            return cmd_report(args, rest)
        if args.command == "convert":
            return cmd_convert(args, rest)
        if args.command == "prepare":
            return cmd_prepare(args, rest)
        if args.command == "estimate":
            return cmd_estimate(args, rest)
        if args.command == "plan":
            return cmd_plan(args, rest)
        if args.command == "calibrate":
            return cmd_calibrate(args, rest)
        if args.command == "generate":
            from shardwise.generate import cmd_generate

            return cmd_generate(args, rest)
        if args.command == "eval":
            from shardwise.eval_command import cmd_eval

            return cmd_eval(args, rest, argv, rank_main)
    except ConfigError as e:
        from shardwise.launch import rank_error

        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        if not rank_error(f"{prefix}{e}", "config"):
            print(f"shardwise: error: {prefix}{e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shardwise plan ... | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception:
        from shardwise.launch import peer_failed_first, rank_error

        if peer_failed_first():  # lost a peer that already reported why: nothing more to say
            return 1
        rank_error(traceback.format_exc().strip().splitlines()[-1], "crash")
        raise
    finally:
        from shardwise.device import leave_distributed

        leave_distributed()  # after the error is recorded: a peer that then fails is the second
    return 1
