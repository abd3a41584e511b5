"""The local launcher behind ``shardwise train --nproc N``: torch's elastic agent (the code behind
``torchrun``) on this machine only, with one line per failure.

- **Ranks forked from the rank server** (shardwise/process.py): the agent runs a function
  entrypoint with the forkserver start method, so N ranks cost one import of torch, not N.
- **Loopback only.** The agent's rendezvous and the ranks' store listen on 127.0.0.1
  (:func:`loopback_stores`), the ranks meet at 127.0.0.1 and gloo uses the loopback interface.
- **One line per failure.** A launched rank records its one-line error (a ``ConfigError``) in a
  folder the launcher gives it (:func:`rank_error`); ranks that fail only because a peer died first
  stay quiet (:func:`peer_failed_first`); the launcher prints the first failing rank's line and
  exits 2 (:func:`first_failure`). An unexpected exception keeps its traceback and exit 1.
- **Stop signals.** SIGTERM/SIGINT are forwarded; the ranks finish their step and save; exit 0 when
  the last logged step was checkpointed (:func:`stopped_cleanly`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardwise.checkpoint import list_checkpoints
from shardwise.config.notice import say
from shardwise.config.schema import ConfigError
from shardwise.launch.process import (
    ERROR_DIR_ENV,
    RanksFailed,
    env_since_server_start,
    set_rank_env,
    start_rank_server,
)


def strip_launcher_flags(argv: list[str]) -> list[str]:
    """The command line a rank runs: the same, minus the flags only the launcher acts on."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--nproc", "--max-restarts"):
            skip = True
            continue
        if a.startswith(("--nproc=", "--max-restarts=")):
            continue
        out.append(a)
    return out


SHUTDOWN_TIMEOUT_S = 300


def stopped_cleanly(run_dir: str) -> bool:
    """After a forwarded stop signal: is the newest committed checkpoint at the last logged step?"""
    found, log = list_checkpoints(Path(run_dir) / "checkpoints"), Path(run_dir) / "metrics.jsonl"
    if not found or not log.is_file() or not (lines := log.read_text().splitlines()):
        return False
    return found[-1][0] == json.loads(lines[-1])["step"]


# A rank launched by `shardwise train --nproc` writes its one-line error here instead of printing
# it; the launcher reports the first failing rank's line once (and exits 2), not N copies of it
# beside the secondary failures of the ranks that lost their peer.
def first_failure(folder: str) -> dict | None:
    import json

    records = []
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                records.append(json.load(f))
    return min(records, key=lambda r: (r["time"], r["rank"])) if records else None


@contextlib.contextmanager
def loopback_stores() -> Iterator[None]:
    """Inside: every TCPStore server this process starts listens on 127.0.0.1 only.

    torch's TCPStore server binds every interface (``*:port``) whatever host it is given, so the
    elastic agent's rendezvous would accept connections from the network. The local launcher's
    ranks are all on this machine: the store gets a listening socket bound to loopback
    (``master_listen_fd``) instead."""
    import socket

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    base = dist.TCPStore

    class LoopbackStore(base):  # type: ignore[misc,valid-type]
        def __init__(self, host_name: str, port: int, **kwargs: Any) -> None:
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(4096)
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns the socket now
            super().__init__(host_name, port, **kwargs)

    dist.TCPStore = c10d_rendezvous_backend.TCPStore = LoopbackStore
    try:
        yield
    finally:
        dist.TCPStore = c10d_rendezvous_backend.TCPStore = base


def launch(argv: list[str], nproc: int, max_restarts: int, run_dir: str,
           entry: Callable[..., None]) -> int:
    """Run ``shardwise <argv>`` on ``nproc`` local ranks with torch's elastic launcher: each rank calls
    ``entry(env, *argv)`` in a process forked from the rank server (shardwise/process.py), ``env``
    being what this process's environment gained since the server started."""
    import logging
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser, parse_args

    start_rank_server(nproc, max_restarts)  # (at once if the command line did not start it)
    set_rank_env(nproc, max_restarts)  # for the agent too (torchrun's code would force 1 thread)
    # On SIGTERM/SIGINT the agent forwards the signal and waits this long for the ranks to finish
    # their step and save before it kills them.
    grace = ([f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"]
             if any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions) else [])
    # Everything on loopback: the rendezvous (see loopback_stores), the address the ranks meet at,
    # and gloo's own connections between them (set_rank_env). Only this machine's ranks can join.
    largs = parse_args(["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4()}",
                        "--local-addr=127.0.0.1", "--nnodes=1", f"--nproc-per-node={nproc}",
                        f"--max-restarts={max_restarts}", "--start-method=forkserver", *grace,
                        "--module", "shardwise", *argv])
    if largs.master_port is None:  # as torchrun's run() does (the c10d rendezvous does not use it)
        largs.master_port = 29500
    launch_config, _, _ = config_from_args(largs)
    # The agent logs each failure with its own traceback; this launcher reports them in one line.
    for name in [n for n in logging.root.manager.loggerDict
                 if n.startswith(("torch.distributed", "torch.multiprocessing"))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="shardwise-errors-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        try:
            with loopback_stores():
                elastic_launch(launch_config, entry)(env_since_server_start(), *argv)
        except SignalException as e:
            if stopped_cleanly(run_dir):
                say(f"shardwise: stopped by {e.sigval.name} with a checkpoint of the last step", err=True)
                return 0
            say(f"shardwise: stopped by {e.sigval.name} before the ranks could save (see above)", err=True)
            return 1
        except ChildFailedError as e:
            first = first_failure(errors)
            if first is not None and first["kind"] == "config":
                raise ConfigError(first["message"]) from None  # (cli.main: one line, exit 2)
            rank = first["rank"] if first is not None else min(e.failures)
            line = first["message"] if first is not None else f"exit code {e.failures[rank].exitcode}"
            raise RanksFailed(f"{len(e.failures)} of {nproc} ranks failed (first: rank {rank}: {line}); "
                              "see its traceback above") from None
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
    return 0
