"""``shardwise`` command line: thin wrappers over the library.

``shardwise train --nproc N`` validates the config for N ranks, prepares the data once, then starts
N ranks through torch's elastic launcher (``torch.distributed.run``, the code behind ``torchrun``,
on loopback; shardwise/launch/agent.py). Each rank re-enters this same command with WORLD_SIZE set, which
is also exactly what happens under an external ``torchrun`` or a Slurm ``srun torchrun`` on many nodes.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from types import ModuleType

from shardwise.commands import COMMANDS, build_parser, common
from shardwise.config.notice import notice, say
from shardwise.config.schema import ConfigError
from shardwise.launch import process


def rank_main(env: dict[str, str | None], *argv: str) -> None:
    """A rank of ``shardwise train --nproc N``, forked from the rank server (shardwise/launch/process.py):
    the command the launcher ran, with the launcher's environment as it is now (``env``: what changed
    since the server started), exactly as under torchrun. Returns on success (the elastic agent then
    collects every rank's return and lets the ranks go; after a stop signal the rank leaves a second
    later, launch/process.exit_after_return); otherwise exits with the command's code."""
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


def parse(argv: list[str]) -> tuple[ModuleType, argparse.Namespace, list[str]]:
    """``argv`` checked and parsed: (the command's module, its flags, the config overrides with
    ``--model``'s preset applied). A bad flag or path raises ConfigError (argparse's own exits)."""
    parser, commands = build_parser()
    common.check_command(argv, commands)
    args, rest = parser.parse_known_args(argv)
    common.check_unknown_flags(commands[args.command], rest)
    common.check_paths(args)
    common.check_nproc(args)
    rest, args.model_note = common.apply_model(args, rest)
    return COMMANDS[args.command], args, rest


def main(argv: list[str] | None = None, raise_errors: bool = False) -> int:
    """The command line ``argv`` (default: this process's), run; returns the exit code. A config
    error is one line on stderr and code 2, or with ``raise_errors`` (shardwise/api.py) raised."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command, args, rest = parse(argv)
        common.nproc_notice(argv)
        if args.model_note and not getattr(command, "OWN_MODEL_NOTICE", False):
            notice(args.model_note)
        args.entry = rank_main  # what a rank this command launches runs (train and eval --nproc)
        return command.run(args, rest, argv)
    except ConfigError as e:
        if raise_errors:
            raise
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        if not process.rank_error(f"{prefix}{e}", "config"):
            say(f"shardwise: error: {prefix}{e}", err=True)
        return 2
    except process.RanksFailed as e:  # (their tracebacks are above; this is the one line)
        if raise_errors:
            raise
        say(f"shardwise: error: {e}", err=True)
        return 1
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
