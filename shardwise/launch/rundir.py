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
- **Overwrite removes exactly what runs wrote there**: each run records its outputs in the run
  record (``.shardwise-record``, :class:`~shardwise.config.outputs.RunRecord`) before it writes
  them; ``run.overwrite`` removes those, except the checkpoint the new run is about to load --
  never a user's file beside or inside them, never through a link, and nothing at all from a
  folder that holds files but no record.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from shardwise.checkpoint import list_checkpoints
from shardwise.config.notice import say
from shardwise.config.outputs import RECORD_NAME, RunRecord, aside_name, link_on_the_way
from shardwise.config.schema import Config, ConfigError
from shardwise.launch.resilience import restart_count

LOCK_NAME = ".shardwise.lock"
# Under `shardwise train --nproc`, the launcher holds the lock and tells its ranks so here.
LOCK_ENV = "SHARDWISE_RUN_LOCK"



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
                    say(f"warning: run.dir '{self.path.parent}' is on a filesystem without file locks: "
                        "a second run there cannot be detected", err=True)
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
                      f"({describe_holder(holder) if holder else 'another process'}): wait for it to finish "
                      "or stop it, or choose another --run.dir")


def read_holder(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe_holder(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {started}"


def take(run_dir: Path) -> RunLock:
    """Hold ``run_dir`` for this process (:class:`RunDirBusy` if a live run does); a stale holder
    taken over is said."""
    lock = RunLock(run_dir).acquire()
    if lock.took_over:
        say(f"notice: took over run.dir from a run that is no longer running "
            f"({describe_holder(lock.took_over)})")
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
    kept = aside_name(path)
    path.rename(kept)
    return kept


def write_config(run_dir: Path, text: str) -> None:
    """Write the resolved ``config.toml``; a different one already there (the config of the run
    this one resumes, before its changes) is kept as ``config.<time>.toml`` -- recorded as the
    run's when the one it replaces was."""
    record, path = RunRecord(run_dir), run_dir / "config.toml"
    ours = "config.toml" in record.entries()
    if (kept := keep_aside(path, text)) and ours:
        record.note(kept.name, "file", created=True)
    record.note("config.toml", "file")
    path.write_text(text)


def note_outputs(run_dir: Path, cfg: Config) -> None:
    """Rank 0, as the run opens: record what this run will write in ``run_dir`` (before it writes)."""
    record = RunRecord(run_dir)
    m = cfg.metrics
    for name, on in (("metrics.jsonl", True), ("loss.png", m.plot), ("memory_peak.json", True),
                     ("memory_breakdown.json", True), ("comm.json", True), ("mlflow-run-id", bool(m.mlflow))):
        if on:
            record.note(name, "file")
    for name, on in (("tb", m.tensorboard), ("wandb", m.wandb), ("traces", cfg.profile.enabled),
                     ("routing", cfg.debug.routing_record or bool(cfg.debug.routing_replay))):
        if on:
            record.note(name, "tree")
    record.make_dir("checkpoints")
    if cfg.checkpoint.export_hf:
        record.make_dir("hf")


def overwrite_plan(run_dir: Path) -> dict[str, str]:
    """What ``run.overwrite`` would remove from ``run_dir`` (its run record), checked: a folder
    holding files but no record never held a run, and a recorded path behind a link out of the
    folder is not followed -- either is a :class:`ConfigError`, before anything is removed."""
    if not run_dir.is_dir():
        return {}
    record = RunRecord(run_dir)
    if not record.exists():
        theirs = sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_NAME, RECORD_NAME))
        if theirs and (what := prior_run(run_dir)):
            raise ConfigError(f"run.overwrite: run.dir '{run_dir}' holds a run ({what}) written before "
                              f"shardwise kept a record of what a run writes ({RECORD_NAME}), so nothing "
                              "there is removed: delete the folder yourself if you want it gone, or choose "
                              "another --run.dir")
        if theirs:
            raise ConfigError(f"run.overwrite: run.dir '{run_dir}' holds {len(theirs)} file(s) or folder(s) "
                              f"('{theirs[0]}'{', ...' if len(theirs) > 1 else ''}) but no record of a "
                              f"shardwise run ({RECORD_NAME}), so nothing there is removed: choose a new or "
                              "empty --run.dir, or remove what you want gone yourself")
        return {}
    entries = record.entries()
    for rel in entries:
        if (link := link_on_the_way(run_dir, rel)) is not None:
            raise ConfigError(f"run.overwrite: '{link}' is a link (to '{os.readlink(link)}'), and the "
                              f"earlier run's '{rel}' lies behind it: nothing is removed through a link: "
                              "remove the old run's files there yourself, or choose another --run.dir")
    return entries


def clear_outputs(run_dir: Path, keep: Path | None = None) -> list[str]:
    """``run.overwrite``: remove what the run record lists (:func:`overwrite_plan`), deepest first,
    except checkpoint ``keep`` (the one this run loads) and the folders holding it; a folder a run
    made is removed only once empty (what a user put in it stays). Returns what was removed."""
    entries = overwrite_plan(run_dir)
    if not entries:
        return []
    base = run_dir.resolve()
    held = keep.resolve() if keep is not None else None
    removed, left = [], {}
    for rel in sorted(entries, key=lambda r: -len(Path(r).parts)):
        kind, p = entries[rel], run_dir / rel
        if held is not None and (held.is_relative_to(base / rel) or (base / rel).is_relative_to(held)):
            left[rel] = kind
            continue
        if p.is_symlink() or p.is_file():
            p.unlink()  # a link is removed itself, never followed
        elif p.is_dir() and kind == "tree":
            shutil.rmtree(p)
        elif p.is_dir():
            if any(p.iterdir()):
                left[rel] = kind  # holds what no run wrote
                continue
            p.rmdir()
        else:
            continue
        removed.append(rel)
    RunRecord(run_dir).rewrite({r: k for r, k in entries.items() if r in left})
    return sorted(removed)


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
                    say(f"run.overwrite: removed {', '.join(removed)} from {run_dir}{kept}")
            run_dir.mkdir(parents=True, exist_ok=True)
            note_outputs(run_dir, cfg)
        dist.barrier()
        yield run_dir
    finally:
        if lock is not None:
            lock.release()
