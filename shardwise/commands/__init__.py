"""The commands of ``shardwise``: one module each (its name, flags, examples and run function) and
the table the CLI dispatches from. Adding a command is a module here and a line in :data:`COMMANDS`.

A command module holds ``NAME``, ``SUMMARY``, ``DESCRIPTION``, ``EXAMPLES``, ``add_arguments(p)`` and
``run(args, overrides, argv) -> int``, and imports what it runs inside ``run``, after its config
checks: the table loads without torch."""

from __future__ import annotations

import argparse
import textwrap
from types import ModuleType

from shardwise.commands import (
    calibrate,
    chat,
    compare,
    convert,
    download,
    estimate,
    evaluate,
    generate,
    plan,
    prepare,
    report,
    train,
    verify,
)
from shardwise.commands.common import HelpFormat, Parser, version

COMMANDS: dict[str, ModuleType] = {m.NAME: m for m in (train, prepare, plan, estimate, calibrate, verify,
                                                       compare, generate, chat, evaluate, convert, download,
                                                       report)}
"""Every command by name, in the order a user meets them (``shardwise --help`` lists them so)."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``shardwise``'s parser and its commands' parsers by name; each command's ``--help`` ends with
    its examples (tests/e2e/test_vocabulary.py parses every one)."""
    parser = Parser(
        prog="shardwise", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="PyTorch-native N-D parallel LLM training.",
        epilog="examples (shardwise COMMAND --help for each command's flags and more examples):\n"
               + "\n".join(f"  {m.EXAMPLES[0]}" for m in COMMANDS.values()))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, m in COMMANDS.items():
        epilog = "examples:\n" + "\n".join(f"  {e}" for e in m.EXAMPLES)
        p = sub.add_parser(name, help=m.SUMMARY, allow_abbrev=False, formatter_class=HelpFormat,
                           description=textwrap.fill(m.DESCRIPTION, 100), epilog=epilog)
        m.add_arguments(p)
    parser.add_argument("--version", action="version", version=version())
    return parser, sub.choices
