"""Launching and holding a run: the local launcher and rank server, the run directory (lock, record,
overwrite) and failure recovery."""
