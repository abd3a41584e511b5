"""Launching and holding a run: the local launcher and rank server, the run directory (lock, record,
overwrite), failure recovery, and ``verify``."""
