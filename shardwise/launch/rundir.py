"""The run directory: who holds it, what a new run may find there, and what ``run.overwrite`` removes.

A run directory holds one run's work. Nothing here deletes or replaces any of it unless the user
asked for exactly that:

- **One writer.** A live run holds ``run.dir/.shardwise.lock`` (an exclusive ``flock`` on it, and
  its host and pid written inside): a second run on the same directory is refused with one line
  naming the holder. The lock dies with its process, so a holder killed by ``kill -9`` or the OOM
  killer leaves a stale file that the next run takes over (with a notice). Under ``--nproc`` the
  launcher holds it for all its ranks (and its restarts); under torchrun or Slurm, rank 0 does.
- **A new run never lands on an old one.** :func:`prior_run` says what an earlier run left
  (checkpoints, logged steps); preflight refuses to start a fresh run there unless the user resumes
  it or asks to overwrite it.
- **Overwrite removes exactly** :data:`RUN_OUTPUTS` -- what a training run writes -- except the
  checkpoint the new run is about to load.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from shardwise.checkpoint import list_checkpoints
from shardwise.config.schema import Config, ConfigError
from shardwise.launch.resilience import restart_count

LOCK_NAME = ".shardwise.lock"
# Under `shardwise train --nproc`, the launcher holds the lock and tells its ranks so here.
LOCK_ENV = "SHARDWISE_RUN_LOCK"

# What a training run writes into run.dir, and so what run.overwrite=true removes (config.toml is
# rewritten by every run). Anything else in the directory -- reports, your own files -- is kept.
RUN_OUTPUTS = ("checkpoints", "hf", "metrics.jsonl", "tb", "loss.png", "memory_breakdown.json",
               "memory_peak.json", "comm.json", "traces", "wandb", "config.*.toml")


class RunDirBusy(ConfigError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive hold on a run directory for the life of this process (or until released)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None
        self.took_over: dict | None = None  # the stale holder's record, if one was taken over

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunDirBusy` naming its holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # e.g. some NFS mounts
                    print(f"warning: run.dir '{self.path.parent}' is on a filesystem without file locks: "
                          "a second run there cannot be detected", file=sys.stderr, flush=True)
                    return self
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise _busy(self.path) from None
            # A releasing holder unlinks the file: if ours is no longer the file at the path, retry.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self.took_over = read_holder(self.path)
            record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
            self.fd = fd
            return self
        raise RunDirBusy(f"run.dir '{self.path.parent}': could not take {LOCK_NAME} (it keeps "
                         "changing): is another run starting there?")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking: a waiter then retries on a fresh file
        except FileNotFoundError:
            pass
        os.close(self.fd)  # closing releases the flock
        self.fd = None


def probe(run_dir: Path) -> None:
    """Raise :class:`RunDirBusy` if a live process holds ``run_dir`` (changes nothing on disk)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise _busy(path) from None
    finally:
        os.close(fd)


def _busy(lock: Path) -> RunDirBusy:
    holder = read_holder(lock)
    return RunDirBusy(f"run.dir '{lock.parent}' is in use by a live run "
                      f"({describe(holder) if holder else 'another process'}): wait for it to finish "
                      "or stop it, or choose another --run.dir")


def read_holder(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {started}"


def take(run_dir: Path) -> RunLock:
    """Hold ``run_dir`` for this process (:class:`RunDirBusy` if a live run does); a stale holder
    taken over is said."""
    lock = RunLock(run_dir).acquire()
    if lock.took_over:
        print(f"notice: took over run.dir from a run that is no longer running "
              f"({describe(lock.took_over)})", flush=True)
    return lock


def held_by_launcher(run_dir: Path) -> bool:
    """True in a rank whose launcher (``shardwise train --nproc``) holds this run directory."""
    return os.environ.get(LOCK_ENV) == str((Path(run_dir) / LOCK_NAME).absolute())


def prior_run(run_dir: Path) -> str:
    """What an earlier run left in ``run_dir`` that a fresh run would overwrite ('' = nothing)."""
    found = [f"step-{s}" for s, _ in list_checkpoints(run_dir / "checkpoints")]
    parts = []
    if found:
        parts.append(f"checkpoints {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}")
    log = run_dir / "metrics.jsonl"
    if log.is_file() and (n := sum(1 for line in log.open() if line.strip())):
        parts.append(f"metrics.jsonl with {n} logged step(s)")
    return " and ".join(parts)


def keep_aside(path: Path, text: str | None = None) -> Path | None:
    """Before ``path`` is rewritten: rename a file already there (unless it holds ``text``) to
    ``<stem>.<its mtime>.<suffix>`` and return the new name."""
    if not path.is_file() or (text is not None and path.read_text() == text):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    kept = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    path.rename(kept)
    return kept


def write_config(run_dir: Path, text: str) -> None:
    """Write the resolved ``config.toml``; a different one already there (the config of the run
    this one resumes, before its changes) is kept as ``config.<time>.toml``."""
    path = run_dir / "config.toml"
    keep_aside(path, text)
    path.write_text(text)


def clear_outputs(run_dir: Path, keep: Path | None = None) -> list[str]:
    """``run.overwrite``: remove :data:`RUN_OUTPUTS` from ``run_dir``, except checkpoint ``keep``
    (the one this run loads) when it lies inside. Returns what was removed."""
    removed = []
    keep = keep.resolve() if keep is not None else None
    for p in sorted(q for pattern in RUN_OUTPUTS for q in run_dir.glob(pattern)):
        name = p.name
        if p.is_dir() and keep is not None and keep.is_relative_to(p.resolve()):
            for child in p.iterdir():  # everything but the checkpoint to load (and its parents)
                if not keep.is_relative_to(child.resolve()):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
                    removed.append(f"{name}/{child.name}")
            continue
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        removed.append(name)
    return removed


@contextlib.contextmanager
def hold(cfg: Config, rank: int) -> Iterator[Path]:
    """Rank 0 holds run.dir for the run (unless its launcher does) and applies run.overwrite --
    never to the checkpoint this run loads."""
    run_dir, lock = Path(cfg.run.dir), None
    try:
        if rank == 0:
            if not held_by_launcher(run_dir):
                lock = take(run_dir)
            if cfg.run.overwrite and restart_count() == 0:  # restarts resume what this run saved
                keep = Path(cfg.checkpoint.path) if cfg.checkpoint.path else None
                if removed := clear_outputs(run_dir, keep):
                    kept = f"; kept {keep}, which this run loads" if keep and keep.exists() else ""
                    print(f"run.overwrite: removed {', '.join(removed)} from {run_dir}{kept}", flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        yield run_dir
    finally:
        if lock is not None:
            lock.release()
