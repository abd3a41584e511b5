"""``shardwise train``: validate the config for N ranks, prepare the data once, then train on
one process or start N ranks through torch's elastic launcher (each re-enters this command, as
under torchrun or Slurm)."""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import textwrap

from shardwise.commands.common import add_model, add_nproc, load_resolved
from shardwise.config import schema as config
from shardwise.config.schema import ConfigError
from shardwise.config.types import toml_value
from shardwise.launch import process

NAME = "train"
SUMMARY = "train a model"
DESCRIPTION = (
    "Train a model. Any config key can be overridden with --section.key=value (see --help-config)."
)
EXAMPLES = (
    "shardwise train --config configs/debug.toml",
    "shardwise train --config configs/debug.toml --nproc 4 --parallel.tp 2",
    "shardwise train --model 125m --data.path corpus/ --training.steps 1000",
    "torchrun --nproc-per-node 8 -m shardwise train --config plan.toml",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml (default: built-in defaults)")
    add_model(p)
    add_nproc(p, "launch this many local ranks (not under torchrun, which sets them)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart all ranks this many times after a rank fails")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")


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
            shown = "(preset)" if default is None else toml_value(default)
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


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    """Train: here on one rank, as a rank under a launcher, or as the launcher of ``--nproc`` ranks."""
    from pathlib import Path

    from shardwise.resolve.checks import load_config
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
    if args.print_config:
        print(load_resolved(args.config, overrides).to_toml(), end="")
        return 0
    cfg = load_config(args.config, overrides)
    if cfg.training.epochs:  # steps from the prepared data (every rank derives the same)
        cfg = load_config(args.config, [*overrides, f"--training.steps={steps_of_epochs(cfg)}"])
    from shardwise.resolve.run import resolve_run

    run = resolve_run(cfg, nproc)  # the layout's refusals, before torch is loaded
    from shardwise.launch.rundir import LOCK_ENV, take
    from shardwise.resolve.preflight import preflight

    run = preflight(run)  # the files' and the data's refusals, before any process group exists
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

        data = run.cfg.data
        prepare(data, run.tokenizer, plan=run.data_plan)  # once, here; the ranks memory-map it
        pack_prepared(data, run.tokenizer, run.cfg.training.seq_len, run.data_plan)  # (the ranks report it)
        from shardwise.launch.agent import launch, strip_launcher_flags

        return launch(strip_launcher_flags(argv), nproc, args.max_restarts, cfg.run.dir, args.entry)
    finally:
        os.environ.pop(LOCK_ENV, None)
        lock.release()
