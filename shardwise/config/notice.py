"""Telling the user about a value resolved for them: one ``notice:`` line, said once per run."""

from __future__ import annotations

import os

LAUNCHED_RANK_ENV = "SHARDWISE_ERROR_DIR"
"""Set by ``shardwise train --nproc`` for its ranks: the folder where a failing rank leaves its one-line
error for the launcher, which also marks a process as a launched rank."""


def notice(text: str) -> None:
    """Tell the user about a value resolved for them, once per run: the process the user started
    speaks (under torchrun, rank 0); ranks started by ``shardwise train --nproc`` stay quiet."""
    if os.environ.get(LAUNCHED_RANK_ENV) or os.environ.get("RANK", "0") != "0":
        return
    print(f"notice: {text}", flush=True)
