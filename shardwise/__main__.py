from shardwise.cli import main
from shardwise.launch.process import quick_exit


def run() -> None:
    """The ``shardwise`` command (console script and ``python -m shardwise`` alike): :func:`main`,
    then the process's exit. (Tests call ``main`` in-process, which never exits.)"""
    quick_exit(main())


if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this module in a worker
    run()
