"""What every command shares: its parser's style and one-line errors, the flags several commands
take (``--nproc``, ``--model``, ``--overwrite``, ``--skip-checksums``), and the checks of a command
line that need nothing but the line. The CLI builds every parser before it imports torch, so
``--help``, a misspelt flag and a config error answer at once.

One vocabulary across the commands: ``--nproc`` is the number of ranks (devices) wherever a command
needs one (``--gpus`` and ``--world``, the planner's older names, still work, with a notice);
``--model`` names a preset wherever a model can be named."""

from __future__ import annotations

import argparse
import difflib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import NoReturn

from shardwise.config.notice import notice
from shardwise.config.schema import Config, preset_toml, section_fields, sections
from shardwise.config.types import ConfigError
from shardwise.models import PRESETS
from shardwise.runtime.hub import is_hub_id, local_model

NPROC_ALIASES = ("--gpus", "--world")
"""Older spellings of ``--nproc`` (plan, estimate), accepted with a notice."""


class HelpFormat(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one to show (not None, "" or a switch's False); the description
    wrapped here and the examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """argparse with its errors (a value of the wrong type, a choice it does not offer, a missing
    flag) raised as one line, as every other bad input is, instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_nproc(p: argparse.ArgumentParser, what: str) -> None:
    """``--nproc``, the one flag for a number of ranks (devices), with the older names hidden."""
    p.add_argument("--nproc", type=int, default=None, help=what)
    for alias in NPROC_ALIASES:
        p.add_argument(alias, type=int, dest="nproc", default=None, help=argparse.SUPPRESS)


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="model preset, e.g. 8b; alone (no --config), its own "
                   "configs/<model>.toml is the base; with --config, it replaces that file's model.name")


def apply_model(args: argparse.Namespace, overrides: list[str]) -> tuple[list[str], str]:
    """``--model NAME``: (overrides with ``--model.name=NAME`` first, what to tell the user). With no
    ``--config``, the preset's own ``configs/<NAME>.toml`` (its sequence, batch, precision) becomes the
    config, not the built-in defaults' debug shape; ``args.config`` is set to it."""
    model = getattr(args, "model", "")
    if not model:
        return overrides, ""
    said = ""
    if not args.config and model in PRESETS:  # (an unknown preset: the config check's error follows)
        if path := preset_toml(model):
            args.config = str(path)
            said = (f"--model {model}: starting from {path.name} (its sequence, batch, precision and "
                    "checkpointing); --config FILE starts from another")
        else:
            said = f"--model {model} has no configs/{model}.toml: the built-in defaults' other sections apply"
    return [f"--model.name={model}", *overrides], said


PATH_FLAGS = ("checkpoint", "hf", "messages", "to_hf", "from_hf", "tasks_path", "adapter")
"""Flags that name an existing file or folder (--config: read_config says more of a missing one)."""
HUB_FLAGS = ("hf", "from_hf")
"""Path flags that take a Hugging Face model folder, or a Hub id in its stead (runtime/hub.py)."""


def check_paths(args: argparse.Namespace) -> None:
    """Each path flag given names something that exists: one line, before any work (and torch). A Hub
    id in an HF folder's flag becomes its snapshot in the cache (fetched there first when missing)."""
    for name in PATH_FLAGS:
        flag = f"--{name.replace('_', '-')}"
        # (convert's --adapter is a switch, generate's a folder)
        if not isinstance(path := getattr(args, name, None), str) or not path:
            continue
        if name in HUB_FLAGS and is_hub_id(path):
            setattr(args, name, str(local_model(path, flag)))
        elif not Path(path).exists():
            raise ConfigError(f"{flag} '{path}' does not exist")


def nproc_notice(argv: list[str]) -> None:
    """A notice for each older spelling of ``--nproc`` on the command line."""
    for alias in NPROC_ALIASES:
        if any(a == alias or a.startswith(alias + "=") for a in argv):
            notice(f"{alias} is now --nproc (one name for the number of ranks in train, plan, estimate, "
                   "verify and eval); the old name still works")


def check_nproc(args: argparse.Namespace) -> None:
    """``--nproc``, where a command has it and it is given, is at least 1 (every command, once)."""
    if (nproc := getattr(args, "nproc", None)) is not None and nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")


def need_nproc(args: argparse.Namespace, what: str) -> int:
    """The ``--nproc`` a command cannot do without (plan, estimate)."""
    if args.nproc is None:
        raise ConfigError(f"{args.command} needs --nproc N: the number of {what}")
    return args.nproc


def version() -> str:
    """``shardwise --version``: the installed package's version."""
    try:
        return f"shardwise {dist_version('shardwise')}"
    except PackageNotFoundError:
        return "shardwise (not installed: run from a source tree)"


def _suggest(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def check_command(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> None:
    """A misspelt command, refused with the nearest one (before argparse's own list)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    if word is not None and argv and not argv[0].startswith("-") and word not in commands:
        raise ConfigError(f"unknown command '{word}'{_suggest(word, list(commands))} "
                          f"(commands: {', '.join(commands)})")


def check_unknown_flags(parser: argparse.ArgumentParser, rest: list[str]) -> None:
    """A flag the command does not have and that is not a --section.key override: refused with the
    nearest flag (``--confg`` -> ``--config``)."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    keys = [f"--{section}.{name}" for section, cls in sections().items() for name in section_fields(cls)]
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and "." not in name and name not in flags:
            same = [k for k in keys if k.rsplit(".", 1)[1] == name[2:]]  # --steps: --training.steps
            hint = (f"; did you mean {' or '.join(repr(k) for k in same)}?" if same
                    else _suggest(name, flags))
            raise ConfigError(f"unknown flag '{name}' for '{parser.prog}'{hint} (config keys take the form "
                              "--section.key=value)")


def add_skip_checksums(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-checksums", action="store_true",
                   help="check the checkpoint's file sizes only, not their SHA-256 (faster on a large one; "
                        "as checkpoint.verify_checksums=false in training)")


def add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing {what} (otherwise an existing file, or a folder holding "
                        "files, is refused)")


def load_resolved(path: str | None, overrides: list[str], device: str | None = None) -> Config:
    """The config as a run on ``device`` resolves it (:func:`shardwise.resolve.checks.resolve_config`):
    what ``--print-config`` shows and what the planner plans from."""
    from shardwise.resolve.checks import load_config, resolve_config

    return resolve_config(load_config(path, overrides), device)


def refuse_lora_costing(cfg: Config, command: str) -> None:
    """The planner counts every parameter's gradient and optimizer state: a LoRA run (frozen base) is
    refused in one line until it counts them as LoRA trains."""
    if cfg.lora.rank:
        raise ConfigError(f"{command}: a LoRA run (lora.rank={cfg.lora.rank}) is not costed yet (its frozen "
                          f"weights have no gradients or optimizer states); {command} with --lora.rank=0 "
                          "gives the full fine-tune's figures, an upper bound")
