"""The tests' CLI fork server (started by tests/helpers.run_cli; not a test module).

A one-rank ``python -m shardwise`` spends 3-4 s of CPU importing torch and the trainer before it
does anything, and the suite starts well over a hundred of them. This process imports them once;
each command is then a fork of it that becomes what ``python -m shardwise ARGS`` would have been:
the command's environment and working directory, its own stdout and stderr files, stdin from
/dev/null, ``shardwise.__main__`` as the main module (so the processes the command starts itself
import what they would), leaving through the command's own exit path.

The helper forks only when the command's environment equals this server's in every variable that
a library reads when it loads (all but PATH and pytest's test name), and runs a fresh interpreter otherwise;
the production launcher forks its ranks the same way (shardwise/launch/process.py).

A command's rank server (multiprocessing's forkserver, which ``--nproc`` ranks are forked from) is
likewise a fork of the command instead of a fresh interpreter importing the same modules again (3-4
s of CPU per multi-rank command): otherwise as multiprocessing starts it -- the command's child,
holding only its listening socket and the read end of the pipe whose end tells it its clients are
gone, so it and its ranks end with the command (:func:`_forked_rank_server`). The ranks then apply
the command's environment on top of the server's as launched ones do (launch/process.enter_rank,
which also sets their thread count).

Protocol, one JSON object per line: request ``{"argv", "env", "cwd", "stdout", "stderr"}`` on
stdin; answers ``{"pid"}`` once forked, then ``{"status"}`` (as subprocess reports it: the exit
code, or minus the signal). The server ends when its stdin closes (the test session ended).
"""

from __future__ import annotations

import inspect
import io
import json
import multiprocessing.forkserver
import os
import socket
import sys
import traceback
import types
from multiprocessing import connection, resource_tracker, util

# What a command imports before it starts work; the rest it imports itself, as it would.
PRELOAD = ["shardwise.cli", "shardwise.__main__", "shardwise.resolve.checks", "shardwise.resolve.preflight",
           "shardwise.launch.rundir", "shardwise.launch.agent", "shardwise.trainer.train", "torch._dynamo",
           "tokenizers", "jinja2"]


def _forked_rank_server(server: multiprocessing.forkserver.ForkServer) -> None:
    """``server.ensure_running`` in a command: a running server stays; else one is forked from this
    process (see the module docstring) where multiprocessing would start an interpreter."""
    with server._lock:
        resource_tracker.ensure_running()
        if server._forkserver_pid is not None:
            if not os.waitpid(server._forkserver_pid, os.WNOHANG)[0]:
                return  # alive
            os.close(server._forkserver_alive_fd)
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            keep = {0, 1, 2, listener.fileno(), alive_r}
            for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:  # (the listing's own descriptor, closed already)
                        pass
            try:
                multiprocessing.forkserver.main(listener.fileno(), alive_r, server._preload_modules)
            finally:
                os._exit(0)
        os.close(alive_r)
        listener.close()
        server._forkserver_address, server._forkserver_alive_fd = address, alive_w
        server._forkserver_pid = pid


# Only where the server's main is the one this code calls (later Pythons add an authentication key:
# there commands start their servers as multiprocessing does).
FORKED_RANK_SERVER = list(inspect.signature(multiprocessing.forkserver.main).parameters) == [
    "listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def _child(request: dict) -> None:
    """In the forked child: become ``python -m shardwise ARGV``; never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        # PYTHONUNBUFFERED, as run_cli asks of a fresh interpreter.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      line_buffering=True, errors="backslashreplace")
        sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin for its lifetime
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if FORKED_RANK_SERVER:
            server = multiprocessing.forkserver._forkserver
            server.ensure_running = types.MethodType(_forked_rank_server, server)
            multiprocessing.forkserver.ensure_running = server.ensure_running  # (the module's alias)
        main = sys.modules["shardwise.__main__"]
        sys.modules["__main__"] = main
        sys.argv = [main.__file__, *request["argv"]]
        sys.path[0] = request["cwd"]  # python -m puts the working directory first
        main.run()  # leaves through os._exit (launch/process.quick_exit) when the command returns
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # what the interpreter would print before exiting 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    import importlib

    sys.path[0] = os.getcwd()  # the repository root (the helper starts the server there)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library not installed: the command imports (and fails) itself
            pass
    answer = sys.stdout
    answer.write(json.dumps({"ready": True}) + "\n")
    answer.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        answer.write(json.dumps({"pid": pid}) + "\n")
        answer.flush()
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        answer.flush()


if __name__ == "__main__":
    serve()
