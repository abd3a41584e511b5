import sys

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this module in a worker
    from shardwise.cli import main

    sys.exit(main())
