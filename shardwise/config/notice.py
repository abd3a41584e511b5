"""What shardwise tells its user while it works, through the ``shardwise`` logger.

:func:`say` is every message of the library (a run's progress lines, notices, warnings); a command's
own result (a plan's table, generated text, a verify report) is the command's output and printed.
At the first message, unless the ``shardwise`` logger has a handler by then, :class:`PlainHandler`
is installed (:func:`install_output`): it prints each message as it is -- INFO to stdout, warnings
(``say(..., err=True)``) to stderr -- so the command line reads as plain lines, and so does a
notebook. ``logging.getLogger("shardwise").setLevel(logging.WARNING)`` silences the progress and
keeps the warnings; a handler of your own on that logger before the first message (a
``logging.NullHandler()`` for none) takes the records instead.
"""

from __future__ import annotations

import logging
import os
import sys

LAUNCHED_RANK_ENV = "SHARDWISE_ERROR_DIR"
"""Set by ``shardwise train --nproc`` for its ranks: the folder where a failing rank leaves its one-line
error for the launcher, which also marks a process as a launched rank."""

LOG = logging.getLogger("shardwise")
if LOG.level == logging.NOTSET:  # INFO reaches a handler of the user's too, not only shardwise's
    LOG.setLevel(logging.INFO)


def say(text: str = "", err: bool = False) -> None:
    """One message for the user (may hold several lines): INFO to stdout, or with ``err`` a WARNING
    to stderr."""
    if not LOG.handlers:
        install_output()
    LOG.log(logging.WARNING if err else logging.INFO, text, extra={"shardwise_err": err})


def notice(text: str) -> None:
    """Tell the user about a value resolved for them, once per run: the process the user started
    speaks (under torchrun, rank 0); ranks started by ``shardwise train --nproc`` stay quiet."""
    if os.environ.get(LAUNCHED_RANK_ENV) or os.environ.get("RANK", "0") != "0":
        return
    say(f"notice: {text}")


class PlainHandler(logging.Handler):
    """Each record's message as ``print`` writes it, flushed, to the stream of the moment (looked up
    at each record, so a redirection or a test's capture applies): stderr for ``say(err=True)`` and
    for other records at WARNING and above, stdout otherwise."""

    def emit(self, record: logging.LogRecord) -> None:
        err = getattr(record, "shardwise_err", record.levelno >= logging.WARNING)
        stream = sys.stderr if err else sys.stdout
        try:
            stream.write(record.getMessage() + "\n")
            stream.flush()
        except BrokenPipeError:  # `shardwise ... | head`: the reader left (the CLI handles it)
            raise
        except Exception:  # noqa: BLE001 - logging's own rule: report, never raise
            self.handleError(record)


def install_output() -> None:
    """The ``shardwise`` logger prints through :class:`PlainHandler` at INFO, once per process, unless
    it already has a handler (yours); it does not also pass records to the root logger's handlers."""
    if LOG.handlers:
        return
    LOG.addHandler(PlainHandler())
    if LOG.level == logging.NOTSET:
        LOG.setLevel(logging.INFO)
    LOG.propagate = False
