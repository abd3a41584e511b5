"""Imported by the rank server only, first (shardwise/process.py preloads it there).

- **It lives exactly as long as its launcher.** The ranks watch their parent, the server, to stop
  when the launcher is gone (resilience.exit_with_launcher). So the server ignores the signals that
  reach a whole process group (Ctrl-C, a terminal's hang-up, ``kill -TERM -<group>``): the launcher
  handles those, forwarding them to the ranks, which save first. The server ends when the launcher
  closes its end of the server's pipe -- on any exit, ``kill -9`` included -- or by SIGKILL.
- **It leaves at once**, instead of tearing torch's modules down for 1-2 s, during which it would
  hold the launcher's stdout open and its ranks would not yet see that the launcher died.

Each rank restores the default handlers (process.enter_rank).
"""

import atexit
import os
import signal

SHIELDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SERVER_PID = os.getpid()

for _sig in SHIELDED:
    signal.signal(_sig, signal.SIG_IGN)


def _leave() -> None:
    if os.getpid() == _SERVER_PID:  # a rank forked from the server runs the exit handlers too
        os._exit(0)


atexit.register(_leave)
