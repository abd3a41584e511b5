import os
import sys

from shardwise.cli import main

QUICK_EXIT = ("plan", "estimate")
"""Commands that leave only printed text and closed files: they skip the interpreter's teardown of
torch's modules and of the model they built on meta (1.0-1.6 s of a 405B plan on a 2-core VM,
against 0.1 s)."""


def run() -> None:
    """The ``shardwise`` command (console script and ``python -m shardwise`` alike): :func:`main`,
    then the process's exit. (Tests call ``main`` in-process, which never exits.)"""
    code = main()
    if sys.argv[1:2] and sys.argv[1] in QUICK_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this module in a worker
    run()
