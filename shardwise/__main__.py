import atexit
import gc
import io
import os
import sys
import threading

from shardwise.cli import main

_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def run() -> None:
    """The ``shardwise`` command (console script and ``python -m shardwise`` alike): :func:`main`,
    then the process's exit. (Tests call ``main`` in-process, which never exits.)"""
    quick_exit(main())


def quick_exit(code: int) -> None:
    """Exit as the interpreter would, less its teardown of torch's modules (1-2 s of CPU per process
    on a 2-core VM, paid by the launcher and by every rank): wait for the threads it would wait for,
    run the exit handlers (multiprocessing's children, wandb, logging), flush every open file, then
    leave with ``code``. Under a profiler or tracer (``python -m cProfile -m shardwise`` writes its
    output after the command returns) it exits normally."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    try:
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        for obj in gc.get_objects():  # open files that nothing closed: flush what they buffer
            if type(obj) in _BUFFERED and not obj.closed and obj.writable():
                try:
                    obj.flush()
                except (OSError, ValueError):
                    pass
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(int(code or 0))


if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this module in a worker
    run()
