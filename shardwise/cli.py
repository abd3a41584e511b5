"""``shardwise`` command line: thin wrappers over the library.

``shardwise train --nproc N`` validates the config for N ranks, prepares the data once, then starts
N ranks through torch's elastic launcher (``torch.distributed.run``, the code behind ``torchrun``,
on loopback; shardwise/launch/agent.py). Each rank re-enters this same command with WORLD_SIZE set, which
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

from shardwise import flags
from shardwise.config import extras
from shardwise.config import schema as config
from shardwise.config.outputs import check_folder, target
from shardwise.config.schema import Config, ConfigError
from shardwise.launch import process


def load_config(path: str | None, overrides: list[str], device: str | None = None,
                world: int | None = None) -> Config:
    """:func:`shardwise.resolve.checks.load_config`, imported on first use: the checks load the
    models and torch, which ``shardwise --help`` and a mistyped subcommand never need."""
    from shardwise.resolve.checks import load_config as load

    return load(path, overrides, device, world)


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


def steps_of_epochs(cfg: config.Config) -> int:
    """training.epochs -> training.steps, said in a notice (the data is prepared first)."""
    from shardwise.config.notice import notice
    from shardwise.data.dataset import epochs_to_steps
    from shardwise.data.tokenizer import load_tokenizer

    t = cfg.training
    steps, windows = epochs_to_steps(cfg.data, load_tokenizer(cfg.data.tokenizer), t.seq_len, t.global_batch,
                                     t.epochs)
    notice(f"training.epochs={t.epochs:g}: {windows:,} training windows of {t.seq_len} tokens at "
           f"global_batch={t.global_batch} make training.steps={steps}")
    return steps


def cmd_train(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from pathlib import Path

    from shardwise.runtime.distributed import launched_world_size

    if args.help_config:
        print(help_text())
        return 0
    if (args.nproc or 0) > 1 and not args.print_config and launched_world_size() is None:
        # The ranks' imports start now, beside this launcher's own and its config checks.
        process.start_rank_server(args.nproc, args.max_restarts)
    world = launched_world_size()
    if world is not None and (args.nproc is not None or args.max_restarts):
        raise ConfigError("--nproc/--max-restarts cannot be used under torchrun: the launcher already "
                          "sets them (use its --nproc-per-node / --max-restarts)")
    nproc = args.nproc if args.nproc is not None else (world or 1)
    cfg = load_config(args.config, overrides, world=None if args.print_config else nproc)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    if cfg.training.epochs:  # steps from the prepared data (every rank derives the same)
        cfg = load_config(args.config, [*overrides, f"--training.steps={steps_of_epochs(cfg)}"], world=nproc)
    from shardwise.launch.rundir import LOCK_ENV, take
    from shardwise.trainer.preflight import preflight

    run = preflight(cfg, nproc)  # all config errors surface here, before any process group exists
    if world is not None or nproc == 1:
        # The trainer's modules are imported only where it runs: the launcher of --nproc ranks
        # starts them a second sooner without torch._dynamo, which the trainer's import brings.
        from shardwise.trainer.train import train
    if world is not None:  # a rank (of this launcher, torchrun or Slurm)
        train(run)
        return 0
    # This process holds run.dir for the whole run, its ranks and their restarts included.
    lock = take(Path(cfg.run.dir))
    os.environ[LOCK_ENV] = str(lock.path.absolute())
    try:
        if nproc == 1:
            train(run)
            return 0
        from shardwise.data.dataset import pack_prepared
        from shardwise.data.prepare import prepare
        from shardwise.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prepare(cfg.data, tokenizer)  # once, here; the ranks memory-map it
        pack_prepared(cfg.data, tokenizer, cfg.training.seq_len)  # (the ranks read it and report it)
        from shardwise.launch.agent import launch, strip_launcher_flags

        return launch(strip_launcher_flags(argv), nproc, args.max_restarts, cfg.run.dir, rank_main)
    finally:
        os.environ.pop(LOCK_ENV, None)
        lock.release()


def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from shardwise.resolve.layouts import fill_layouts, parse_layout

    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    layouts = fill_layouts(args.layouts, args.nproc)  # a bad one fails before any run (and torch)
    base = load_config(args.config, [*overrides, f"--training.steps={args.steps}"])
    if args.layouts is None and base.model.n_experts:  # an MoE model's standard layouts add EP
        layouts = fill_layouts(None, args.nproc, experts=True)
    for text in layouts:  # each layout as the trainer will check it, before the reference runs
        layout_overrides, world = parse_layout(text)
        load_config(args.config, [*overrides, *layout_overrides], world=world)
    check_folder(args.out, "--out")
    from shardwise.launch.verify import verify

    return 0 if verify(base, args.config, overrides, layouts, args.steps, Path(args.out),
                       args.moe_routing, args.localize) else 1


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from pathlib import Path

    from shardwise.observe.trace import compare

    if extra:
        raise ConfigError(f"compare takes two trace files and --rtol only, got {' '.join(extra)}")
    if args.rtol < 0:
        raise ConfigError(f"--rtol {args.rtol} must be >= 0 (0: bitwise)")
    same, report = compare(Path(args.a), Path(args.b), args.rtol)
    print(report)
    return 0 if same else 1


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


def cmd_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from shardwise.checkpoint import hf as convert

    if args.to_hf:
        if overrides or args.config or args.toml:
            raise ConfigError("convert --to-hf reads the model config from the checkpoint's manifest: "
                              "drop --config, --toml and overrides")
        from shardwise.checkpoint import checkpoint_or_latest

        source = Path(args.to_hf)
        source = checkpoint_or_latest(source) if source.is_dir() else source  # (a run: its latest)
        where = target(args.out, "--out", args.overwrite)
        with where.staging() as staging:
            files = convert.export_hf(source, staging, args.dtype,
                                      checksums=not args.skip_checksums)
        print(f"exported {source} -> {args.out} ({len(files)} safetensors file(s), {args.dtype})")
        return 0
    out = Path(args.out)
    toml = Path(args.toml or f"{out}.toml")
    where, where_toml = target(out, "--out", args.overwrite), target(toml, "--toml", args.overwrite,
                                                                     folder=False)
    cfg = load_config(args.config, overrides)
    # The model comes from config.json unless the user named one (a preset or model fields).
    from shardwise.config.types import read_toml
    from shardwise.models.hf_config import hf_tokenizer

    named = bool(args.config and "model" in read_toml(Path(args.config), "config file")) or any(
        o.startswith("--model.") for o in overrides)
    with where.staging() as staging:
        _, model = convert.import_hf(Path(args.from_hf), staging, cfg.model if named else None)
    cfg.model = model
    cfg.checkpoint.path = str(out)
    cfg.data.tokenizer = cfg.data.tokenizer or hf_tokenizer(Path(args.from_hf))  # the model's own
    # The config trains elsewhere too: keep `auto` precision for the machine that trains, not this one's.
    cfg.training.mixed_precision = config.read_config(args.config, overrides).training.mixed_precision
    where_toml.write(cfg.to_toml())
    print(f"imported {args.from_hf} -> {out} (model {model.name or 'from config.json'}); train from it: "
          f"shardwise train --config {toml}")
    return 0


def cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from shardwise.data.prepare import prepare
    from shardwise.data.tokenizer import load_tokenizer

    cfg = load_config(args.config, overrides)
    from shardwise.data.dataset import pack_prepared  # (after the config's checks: it imports torch)

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    for where in prepare(cfg.data, tokenizer):
        m = json.loads((where / "manifest.json").read_text())
        bad = f", {m['bad_rows']:,} bad rows skipped" if m["bad_rows"] else ""
        print(f"{where}: {m['shards']} shard(s), {m['docs']:,} documents and {m['tokens']:,} tokens to "
              f"train on, {m['val_docs']:,} documents and {m['val_tokens']:,} tokens held out{bad}")
    for line in pack_prepared(cfg.data, tokenizer, cfg.training.seq_len):  # chat: whole conversations
        print(line)
    return 0


def cmd_estimate(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardwise.config.notice import notice
    from shardwise.plan.hardware import load_hardware, profile_device

    world = flags.need_nproc(args, "ranks (devices) to estimate for")
    # training.mixed_precision=auto resolves for the planned device, not for this machine.
    cfg = load_config(args.config, overrides, device=profile_device(args.hardware), world=world)
    if said := extras.plan_without_float8(cfg):
        notice(said)
    hw = load_hardware(args.hardware, cfg.data.cache_dir)
    from shardwise.plan.estimate import estimate, estimate_json, format_estimate
    from shardwise.resolve.run import resolve_run

    # The trainer's own refusals, one line each (for the planned machine, not this one's device).
    resolve_run(cfg, world, detect_device=False)
    where = target(args.json, "--json", args.overwrite, folder=False) if args.json else None
    est = estimate(cfg, world, hw)
    print(format_estimate(est))
    if where is not None:
        where.write(estimate_json(est))
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import time

    from shardwise.config.notice import notice
    from shardwise.plan.hardware import load_hardware, profile_device

    gpus = flags.need_nproc(args, "devices to plan for")
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
    cfg = load_config(args.config, overrides, device=profile_device(args.hardware))
    without_float8 = extras.plan_without_float8(cfg)
    hw = load_hardware(args.hardware, cfg.data.cache_dir)
    from shardwise.plan.search import (
        data_note,
        format_plan,
        layout_toml,
        parse_tokens,
        plan,
        plan_config,
        run_command,
        shape_differs,
        why_nothing,
    )

    default_out = args.out is None
    args.out = "plan.toml" if default_out else args.out
    where = (target(args.out, "--out", args.overwrite, default=default_out, folder=False, example="plan.toml")
             if args.out else None)
    seq = args.seq or cfg.training.seq_len
    tokens = (parse_tokens(args.global_batch_tokens) if args.global_batch_tokens
              else max(cfg.training.global_batch, gpus) * seq)
    cfg = plan_config(cfg, seq, tokens)
    notes = [n for n in (args.model_note, without_float8, shape_differs(cfg), data_note(cfg)) if n]
    start = time.perf_counter()
    result = plan(cfg, gpus, hw, args.top, args.memory_fraction, ac, schedules)
    print(format_plan(result, cfg, gpus, hw))
    print(f"({time.perf_counter() - start:.1f} s)")
    if not result.top:
        print(why_nothing(result, cfg, gpus, hw, args.memory_fraction, not args.global_batch_tokens),
              file=sys.stderr)
        return 1
    if args.out:
        if said := where.write(layout_toml(result.top[0], args.out, tuple(notes))):
            notice(said)
        print(f"best layout written to {args.out}: {run_command(args.out, gpus, hw)}")
    for n in notes:
        notice(n)
    return 0


def cmd_calibrate(args: argparse.Namespace, extra: list[str]) -> int:
    from shardwise.plan.calibrate import calibrate
    from shardwise.plan.hardware import local_path

    cfg = load_config(None, extra)
    print("calibrating this machine ...", flush=True)
    calibrate(cfg.data.cache_dir, quick=args.quick)
    print(f"saved {local_path(cfg.data.cache_dir)}: use --hardware local")
    return 0


def rank_main(env: dict[str, str | None], *argv: str) -> None:
    """A rank of ``shardwise train --nproc N``, forked from the rank server (shardwise/launch/process.py):
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
    parser, commands = flags.build_parser()
    try:
        flags.check_command(argv, commands)
        args, rest = parser.parse_known_args(argv)
        flags.check_unknown_flags(commands[args.command], rest)
        flags.nproc_notice(argv)
        flags.check_paths(args)
        flags.check_nproc(args)
        if args.command == "eval":  # its base config is the run's: the overrides' keys and types now
            config.read_config(None, rest)
        rest, args.model_note = flags.apply_model(args, rest)
        if args.model_note and args.command != "plan":  # (plan writes it into its config, and says it)
            from shardwise.config.notice import notice

            notice(args.model_note)
        if args.command == "train":
            return cmd_train(args, rest, argv)
        if args.command == "verify":
            return cmd_verify(args, rest)
        if args.command == "report":
            return cmd_report(args, rest)
        if args.command == "compare":
            return cmd_compare(args, rest)
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
            from shardwise.infer.generate import cmd_generate

            return cmd_generate(args, rest)
        if args.command == "eval":
            from shardwise.infer.eval_command import cmd_eval

            return cmd_eval(args, rest, argv, rank_main)
    except ConfigError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        if not process.rank_error(f"{prefix}{e}", "config"):
            print(f"shardwise: error: {prefix}{e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shardwise plan ... | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception:
        if process.peer_failed_first():  # lost a peer that already reported why: nothing more to say
            return 1
        process.rank_error(traceback.format_exc().strip().splitlines()[-1], "crash")
        raise
    finally:
        from shardwise.runtime.distributed import leave_distributed

        leave_distributed()  # after the error is recorded: a peer that then fails is the second
    return 1
