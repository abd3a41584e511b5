"""Stopping and failing well: graceful SIGTERM/SIGINT, restarts after a rank dies, non-finite steps.

- :class:`StopRequest`: a signal handler only sets a flag; at the end of each step every rank
  learns (one tiny all-reduce on its own gloo group) whether *any* rank was signalled, so all of
  them finish the same step, save, and exit together -- a signal reaching one rank a step later
  than another (as under a launcher forwarding it) cannot split the job.
- :func:`restart_count`: under torch's elastic agent (``torchrun --max-restarts`` or ``shardwise
  train --max-restarts``) a restarted attempt resumes from the latest checkpoint.
- :class:`NonFiniteError`: a NaN/inf gradient norm with ``training.nonfinite = stop``.
- :func:`maybe_fail`, :func:`plant_spike`: the fault injections their tests use.
- :func:`exit_with_launcher`: a rank dies within a second of its launcher.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from shardwise.config.notice import say
from shardwise.config.schema import ConfigError, DebugConfig
from shardwise.data.dataset import IGNORE_INDEX, Batch
from shardwise.launch import process


class NonFiniteError(ConfigError):
    """Training stopped on a NaN/inf gradient norm (one line, like a config error)."""


def restart_count() -> int:
    """How many times the elastic agent has restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class StopRequest:
    """Turns SIGTERM/SIGINT into a request that every rank agrees on at a step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.received: str | None = None
        self.group = group  # a gloo group of every rank: a CPU flag, apart from training's collectives
        self._previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        process.note_stop()

    def agreed(self) -> bool:
        """True on every rank once any rank has been signalled (collective)."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.received is None:
            self.received = "a signal on another rank"
            process.note_stop()
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def exit_with_launcher(poll_s: float = 0.5) -> bool:
    """Under torch's elastic agent (``torchrun``, ``shardwise train --nproc``): kill this rank, and
    whatever it started, within ``poll_s`` of the agent's death. Returns whether it watches.

    Each rank runs in a session of its own (torchrun's agent starts it so; ``--nproc``'s ranks leave
    the launcher's in process.enter_rank), so when the launcher is SIGKILLed (the OOM killer, a job
    scheduler) nothing stops its ranks: they would go on training and writing
    checkpoints into the run directory for minutes, beside any run resumed there. A daemon thread
    notices the re-parenting (the parent pid changes; under ``--nproc`` the parent is the rank
    server, which ends with the launcher) and SIGKILLs the rank's process group -- a
    checkpoint in flight is never half-visible (atomic commit), and every other rank dies alike."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or (parent := os.getppid()) == 1:
        return False

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        say(f"shardwise: [rank {os.environ.get('RANK', '?')}] the launcher (pid {parent}) is gone: "
            "stopping this rank", err=True)
        if os.getpgrp() == os.getpid():  # our own group (the agent's new session): children too
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="shardwise-launcher-watch", daemon=True).start()
    return True


def maybe_fail(debug: DebugConfig, step: int, rank: int) -> None:
    """Fault injection for the restart test: SIGKILL this rank at ``debug.fail_step`` (first
    attempt only, so the restarted job runs through)."""
    if debug.fail_step == step and debug.fail_rank == rank and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def plant_spike(debug: DebugConfig, step: int, batches: list[Batch], vocab_size: int) -> list[Batch]:
    """Fault injection for the spike tests: at ``debug.spike_step`` every token of the step's batch
    (the labels the loss counts too) is drawn uniformly from the vocabulary, the same on every rank."""
    if debug.spike_step != step:
        return batches
    g = torch.Generator().manual_seed(step)
    out = []
    for b in batches:
        tokens = torch.randint(0, vocab_size, (b.inputs.shape[0], b.inputs.shape[1] + 1), generator=g)
        labels = torch.where(b.labels == IGNORE_INDEX, b.labels, tokens[:, 1:].to(b.labels.device))
        out.append(dataclasses.replace(b, inputs=tokens[:, :-1].to(b.inputs.device), labels=labels))
    return out


def nonfinite_message(step: int, grad_norm: float, loss: float, last_checkpoint: str | None) -> str:
    kept = (f"the last checkpoint {last_checkpoint} holds the last good state (resume from it with "
            "--checkpoint.resume true)" if last_checkpoint else "no checkpoint was saved yet")
    return (f"step {step}: non-finite gradient norm {grad_norm} (loss {loss}); stopped before the "
            f"optimizer step, {kept}: lower optimizer.lr or check the data, or set training.nonfinite=skip")
