"""How a shardwise process ends, and where the local launcher's ranks start from.

- :func:`quick_exit`: every command leaves through it. It does what the interpreter's exit does
  (threads, exit handlers, buffered files) less the teardown of torch's modules, 1-2 s of CPU per
  process on a 2-core VM.
- **The rank server.** ``shardwise train --nproc N`` forks its N ranks from one process that imported
  the trainer once (multiprocessing's forkserver with the trainer's modules preloaded), instead of
  starting N interpreters that each import torch: 3-4 s of CPU per rank on a 2-core VM, paid N times
  at every start and every restart. :func:`start_rank_server` starts it as soon as the command line
  asks for local ranks, so its imports run while the launcher checks the config. The server only
  imports (no tensor is made, CUDA is not touched), so forking from it is as safe as torchrun's
  fresh processes; each rank leaves the launcher's session, as torchrun's do, so a Ctrl-C reaches
  the ranks once, through the launcher.

A bottom layer: it imports nothing that loads torch (``shardwise --help`` stays instant).
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import time

from shardwise.config.notice import LAUNCHED_RANK_ENV
from shardwise.runtime.machine import environment_kept, rank_threads

_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)

# What a rank imports before its first step: the server imports them once, every rank inherits them.
# First shardwise.launch.rank_server (the server's own rules: it ignores group signals, leaves at once);
# besides shardwise's own, torch._dynamo (FSDP2 imports it at its first shard, through
# torch._disable_dynamo), the tokenizer library and the chat template's engine (loaded by the config
# checks); a module that is not installed is left out.
RANK_MODULES = ["shardwise.launch.rank_server", "shardwise.cli", "shardwise.resolve.checks",
                "shardwise.resolve.preflight", "shardwise.launch.rundir", "shardwise.launch.agent",
                "shardwise.trainer.train", "torch._dynamo", "tokenizers", "jinja2"]


def finish() -> None:
    """What the interpreter does on exit before it tears its modules down: wait for the threads it
    would wait for, run the exit handlers (multiprocessing's children, wandb, logging), flush every
    open file."""
    if threading.current_thread() is threading.main_thread():
        # The interpreter's own first step, in its order: the threading exit hooks (a thread pool's
        # idle workers are told to stop there), then the join of every non-daemon thread. Joining
        # first waits forever for a pool that nothing shut down.
        threading._shutdown()
    else:
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon and t is not threading.main_thread():
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


def quick_exit(code: int) -> None:
    """Exit as the interpreter would (:func:`finish`), less its teardown of torch's modules, with
    ``code``. Under a profiler or tracer (``python -m cProfile -m shardwise`` writes its output after
    the command returns) it exits normally."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    try:
        finish()
    finally:
        os._exit(int(code or 0))


_stopping = False  # a stop signal reached this rank, or its peers agreed to stop on one


def note_stop() -> None:
    """This rank is stopping on a signal (resilience.StopRequest): see :func:`exit_after_return`."""
    global _stopping
    _stopping = True


def exit_after_return(grace_s: float = 1.0) -> None:
    """In a rank that is about to return its result to the elastic agent, after a stop signal
    (:func:`note_stop`): exit ``grace_s`` after. Without one it does nothing.

    The agent's worker puts the return value in a pipe (a synchronous write), then waits for the
    agent to say it read every rank's, on a multiprocessing Event. An agent that is shutting down
    (it forwarded a stop signal, which this rank obeyed by saving and returning) never says so: it
    waits for the rank to exit, up to its shutdown timeout, then kills it; the value stays readable
    in the pipe after the exit, so leaving is right there. Otherwise the rank must wait for the
    Event: a rank that left while waiting on it would never acknowledge its wake-up, and the
    agent's ``Event.set()`` -- reached once the last rank returns, which may be many seconds later
    (rank 0 gathering lm-eval's metrics) -- would wait for it forever."""
    if not _stopping:
        return

    def leave() -> None:
        time.sleep(grace_s)
        os._exit(0)

    threading.Thread(target=leave, name="shardwise-rank-exit", daemon=True).start()


def set_rank_env(nproc: int, max_restarts: int) -> None:
    """The environment the launcher and its ranks run in (set before the rank server starts: the
    ranks inherit the server's environment, and OpenMP reads its thread count when torch loads)."""
    # One thread per core share (torchrun would force 1 and warn); an OMP_NUM_THREADS that would
    # put more threads than cores on the machine is lowered (preflight says so).
    os.environ["OMP_NUM_THREADS"] = str(rank_threads(nproc)[0])
    if max_restarts:
        # Restarted ranks sharing the launcher's rendezvous store read the dead attempt's gloo
        # addresses and cannot connect (pytorch/pytorch#135712); a store per attempt avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # gloo's own connections between the ranks stay on loopback, like the rendezvous.
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


_server_env: dict[str, str] | None = None  # this process's environment when it started the server


def start_rank_server(nproc: int, max_restarts: int) -> None:
    """Set the ranks' environment and start the rank server, which imports :data:`RANK_MODULES`
    in the background while this process goes on. Once per process: later calls do nothing."""
    global _server_env
    if _server_env is not None:
        return
    # Only the server takes them now: a caller of cli.main (a test, a notebook) whose command then
    # fails its checks keeps its environment. The launcher sets them again to launch.
    with environment_kept():
        set_rank_env(nproc, max_restarts)
        _server_env = dict(os.environ)
        multiprocessing.set_forkserver_preload(RANK_MODULES)
        multiprocessing.forkserver.ensure_running()


def env_since_server_start() -> dict[str, str | None]:
    """What this process's environment gained, changed (the value) or lost (None) since it started
    the rank server: the ranks inherit the server's environment and apply this on top."""
    start = _server_env or {}
    changed: dict[str, str | None] = {k: v for k, v in os.environ.items() if start.get(k) != v}
    return {**changed, **{k: None for k in start if k not in os.environ}}


def enter_rank(env: dict[str, str | None]) -> None:
    """First thing in a rank forked from the rank server, to be what torchrun would have started:
    take the launcher's environment as it is now (``env``: :func:`env_since_server_start`, taken
    before the elastic agent started, so it holds none of the variables the agent sets per rank);
    leave the launcher's session (a Ctrl-C reaches the ranks once, through the launcher) with the
    default signal handlers; write output as it comes (torchrun runs its ranks with ``python -u``)."""
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if threads := os.environ.get("OMP_NUM_THREADS"):
        # OpenMP read it when the server loaded torch; a launcher that started the server for another
        # rank count (one process launching twice, in-process) may since have changed it.
        import torch

        torch.set_num_threads(int(threads))
    # The server hands each child the launcher's end of the pipe whose closing tells the server the
    # launcher is gone (so that the child could ask the server for processes of its own). Kept open
    # here, it would keep the server alive after a kill -9 of the launcher, and with it this rank,
    # which watches its parent (resilience.exit_with_launcher). A rank that starts processes this
    # way gets a server of its own.
    server = multiprocessing.forkserver._forkserver
    if (fd := getattr(server, "_forkserver_alive_fd", None)) is not None:
        os.close(fd)
        server._forkserver_alive_fd = None
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the server ignores them (shardwise/rank_server.py)
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # its name in top and ps -o comm (Linux; 15 characters at most)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(f"shardwise-r{os.environ.get('RANK', '')}"[:15])
    except OSError:
        pass
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=True)


# A launched rank records its failure where the launcher reads it (agent.launch); light enough for
# cli.main to report a config error without loading torch.
ERROR_DIR_ENV = LAUNCHED_RANK_ENV


class RanksFailed(RuntimeError):
    """Ranks of a locally launched command failed; the message names the first and its error line
    (the command line prints it, ``shardwise.train(nproc=N)`` raises it)."""


def rank_error(message: str, kind: str) -> bool:
    """In a launched rank: record this rank's failure for the launcher. Returns whether it did."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    import json
    import time

    tmp = os.path.join(folder, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump({"rank": int(rank), "time": time.time(), "kind": kind, "message": message}, f)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))
    return True


def peer_failed_first() -> bool:
    """In a launched rank: has another rank already recorded a failure? (Then this rank's own error
    is most likely the consequence: a collective whose peer is gone.)"""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    return bool(folder and any(f != f"rank{rank}.json" and f.startswith("rank")
                               for f in os.listdir(folder)))
