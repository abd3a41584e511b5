"""Saving checkpoints: what a checkpoint holds, the atomic commit, retention, async saves.

Atomic commit: a save is written into ``step-<N>.tmp``; once every rank's files are on disk and
fsynced, rank 0 writes the manifest into it and renames the directory to ``step-<N>``. A rename
is atomic, so a ``step-<N>`` directory is complete whatever moment a crash or ``kill -9`` hits.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardwise.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    exception_chain,
    list_checkpoints,
    set_aside,
    sha256,
)
from shardwise.config.notice import say
from shardwise.config.outputs import RunRecord
from shardwise.config.schema import CheckpointConfig
from shardwise.data.dataset import PackedLoader


def rng_state() -> dict[str, Any]:
    """Every RNG a step can draw from -- torch CPU and accelerator, Python's and NumPy's -- as
    tensors and plain numbers, so that it loads with ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def app_state(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, loader: PackedLoader,
               step: int) -> dict[str, Any]:
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:  # torch made the states with a zero-gradient step at lr 0 and counted it: a step the run
        # never took, which would shift AdamW's bias correction of every later step (a run saving at
        # step 0, checkpoint.save_initial, would train otherwise than one that does not)
        for states in (optimizer.state.values(), optim_sd.get("state", {}).values()):
            for state in states:
                if torch.is_tensor(state.get("step")):
                    state["step"].zero_()
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    # The schedule's shape (warmup, total steps) always comes from the config; the checkpoint
    # carries only where in it the run is.
    return {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": sched,
            "dataloader": loader.state_dict(), "train": {"step": step}}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What an interrupted save (step-<N>.tmp) or deletion (step-<N>.deleting) leaves: removed at the
# next save. Nothing else in the folder is touched (a user's notes.tmp stays).
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|deleting)$")


def _file_record(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of ``path``, after forcing it to stable storage."""
    with path.open("rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def _remove(path: Path) -> None:
    """Delete a directory so that no half-deleted ``step-<N>`` is ever visible: rename, then delete."""
    doomed = path.with_name(path.name + ".deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _errno(e: BaseException) -> int | None:
    return next((c.errno for c in exception_chain(e) if isinstance(c, OSError) and c.errno is not None), None)


def _reason(e: BaseException) -> str:
    """The OS-level cause inside a (possibly DCP-wrapped) save failure, as one short phrase."""
    for c in exception_chain(e):
        if isinstance(c, OSError) and c.errno is not None:
            return f"{os.strerror(c.errno)}" + (f" ({c.filename})" if c.filename else "")
    inner = exception_chain(e)[-1]
    return f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"


class Checkpointer:
    """Saves (sync or async) and commits checkpoints under ``folder``; collective over all ranks.

    ``info`` (layout, model config) goes into each manifest. ``group``: a gloo group over every rank
    used by nothing else (created here when not given; every rank must then create it at the same
    point). ``record`` (rank 0 of a training run): the run record each committed checkpoint joins."""

    def __init__(self, folder: Path, cfg: CheckpointConfig, info: dict[str, Any],
                 group: dist.ProcessGroup | None = None, record: RunRecord | None = None) -> None:
        self.folder, self.cfg, self.info, self.record = folder, cfg, info, record
        self.retired_steps: list[int] = []  # deleted by keep_latest_k since the caller last looked
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._executor = ThreadPoolExecutor(1, "shardwise-ckpt") if cfg.async_mode != "none" else None
        self._pending: Future | None = None
        self._local_error: str | None = None
        self.blocked_s = 0.0  # how long the last save() held up training

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        """Whether ``step`` is saved: every checkpoint.interval steps, the last one (checkpoint.final),
        and the step a stop request ends the run at."""
        c = self.cfg
        return (c.interval > 0 and step % c.interval == 0) or (c.final and last) or stopping

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, loader: PackedLoader,
             block: bool = False) -> Path:
        """Save step ``step``; with async_mode, return once the state is copied (``block``: wait for
        the commit too). Returns the directory the checkpoint has (or will have) once committed."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time: its collectives own the group
        staging = self.folder / f"step-{step}.tmp"
        status = [None]
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                for p in self.folder.iterdir():  # leftovers of interrupted saves/deletions (only)
                    if _LEFTOVER.match(p.name) and p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                staging.mkdir()
            except OSError as e:
                status[0] = self._failed(step, e)
        dist.broadcast_object_list(status, src=0, group=self.group)
        if status[0]:
            raise CheckpointError(status[0])
        state = app_state(model, optimizer, scheduler, loader, step)
        try:
            torch.save(rng_state(), staging / f"rng-rank{self.rank}.pt")
        except (OSError, RuntimeError) as e:  # torch.save: RuntimeError on a short write. Reported
            # after the DCP write, since every rank must reach the same collectives
            self._local_error = self._failed(step, e)
        if self._executor is None or block:
            self._write_and_commit(step, staging, lambda: dcp.save(
                state, checkpoint_id=str(staging), process_group=self.group))
        else:
            kind = AsyncCheckpointerType.PROCESS if self.cfg.async_mode == "process" else \
                AsyncCheckpointerType.THREAD
            try:  # returns once the state is copied to host memory
                upload = dcp.async_save(state, checkpoint_id=str(staging), process_group=self.group,
                                        async_checkpointer_type=kind)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported as one line
                raise CheckpointError(self._failed(step, e)) from None
            self._pending = self._executor.submit(self._write_and_commit, step, staging, upload.result)
        self.blocked_s = time.perf_counter() - t0
        return self.folder / f"step-{step}"

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()

    def close(self) -> None:
        """Finish the save in flight, then release the background worker (collective)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def _failed(self, step: int, e: BaseException) -> str:
        latest = list_checkpoints(self.folder)
        kept = f"the last checkpoint {latest[-1][1].name} is intact" if latest else "no earlier checkpoint"
        reason, full = _reason(e), _errno(e) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        if _errno(e) is None:
            # torch's zip writer reports a short write as "unexpected pos ..." without the errno;
            # a filesystem with less room than the last checkpoint took is the likely cause.
            free = shutil.disk_usage(self.folder).free
            need = sum(f.stat().st_size for f in latest[-1][1].iterdir()) if latest else 64 << 20
            if free < need:
                reason, full = f"No space left on device ({free / 2**20:.1f} MiB free)", True
        hint = ("free disk space, lower checkpoint.keep_latest_k, or set run.dir elsewhere" if full
                else "check that run.dir is writable and has space")
        return f"could not save checkpoint step-{step} in '{self.folder}': {reason}: {hint} ({kept})"

    def _write_and_commit(self, step: int, staging: Path, write: Any) -> None:
        """Run ``write`` (DCP save, or wait for the async one), then commit: fsync and hash every
        file (each rank its share), rank 0 writes the manifest and renames staging -> step-<N>."""
        status: list[str | None] = [None]
        try:
            write()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank when
            # any rank failed (its CheckpointException derives from BaseException)
            status[0] = self._failed(step, e)
        status[0] = status[0] or self._local_error
        self._local_error = None
        # Everyone agrees on success before anything becomes visible.
        flags = [None] * self.world
        dist.all_gather_object(flags, status[0], group=self.group)
        if errors := [f for f in flags if f]:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(errors[0])
        names = sorted(p.name for p in staging.iterdir()) if self.rank == 0 else None
        box = [names]
        dist.broadcast_object_list(box, src=0, group=self.group)
        mine: dict[str, Any] = {}
        try:
            mine = {n: _file_record(staging / n) for n in box[0][self.rank::self.world]}
        except OSError as e:
            mine = {"_error": self._failed(step, e)}
        records: list[Any] = [None] * self.world
        dist.all_gather_object(records, mine, group=self.group)
        if self.rank == 0:
            status[0] = next((r["_error"] for r in records if "_error" in r), None)
            if status[0] is None:
                try:
                    self._publish(step, staging, {k: v for r in records for k, v in r.items()})
                except OSError as e:
                    status[0] = self._failed(step, e)
            if status[0]:
                shutil.rmtree(staging, ignore_errors=True)
        dist.broadcast_object_list(status, src=0, group=self.group)
        if status[0]:
            raise CheckpointError(status[0])

    def _publish(self, step: int, staging: Path, files: dict[str, Any]) -> None:
        """Rank 0: manifest in, rename into place, then retention."""
        _commit(staging, self.folder / f"step-{step}", {
            "step": step, "world_size": self.world, **self.info, "files": files,
            "contents": ["model", "optimizer", "lr_scheduler", "dataloader", "train"]})
        if self.record is not None:
            self.record.note(f"{self.folder.name}/step-{step}", "tree", created=True)
        for old in retired(list_checkpoints(self.folder), step, self.cfg.keep_latest_k):
            try:
                _remove(old)
                self.retired_steps.append(int(old.name.removeprefix("step-")))
            except OSError as e:  # the new checkpoint is committed; an old one lingering is harmless
                say(f"warning: could not delete old checkpoint '{old}': {e}", err=True)


def retired(found: list[tuple[int, Path]], committed: int, keep: int) -> list[Path]:
    """What ``keep_latest_k = keep`` deletes after step ``committed`` was saved: the checkpoints
    older than it beyond the newest ``keep`` (it included). Never the one just committed, never a
    newer one (the run directory's guard keeps those from existing; if one does, it is not this
    run's to delete)."""
    if keep <= 0:
        return []
    older = [p for s, p in found if s < committed]
    return older[:max(0, len(older) - (keep - 1))]


def save_model_only(path: Path, state: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    """Write a weights-only checkpoint into folder ``path`` (new or empty) from one process: the DCP
    files, then the manifest with their checksums, last and atomically (a folder without one reads
    as incomplete). A caller writing where a user keeps files stages ``path`` (config/outputs.py)."""
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise CheckpointError(f"'{path}' is not empty: a checkpoint is written into a new or empty folder")
    with warnings.catch_warnings():  # (DCP warns that it assumes one process, as asked)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    files = {p.name: _file_record(p) for p in sorted(path.iterdir())}
    _write_manifest(path, {"step": 0, "world_size": 1, "contents": ["model"], **info, "files": files})


def _write_manifest(folder: Path, fields: dict[str, Any]) -> None:
    """The manifest into ``folder``: temporary name, fsync, rename, folder fsynced."""
    manifest = {"format": FORMAT, "created": time.time(), "torch": torch.__version__, **fields}
    tmp = folder / (MANIFEST + ".part")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)
    _fsync_dir(folder)


def _commit(staging: Path, final: Path, fields: dict[str, Any]) -> None:
    """Write the manifest into ``staging``, then make ``staging`` the complete checkpoint ``final``
    with one rename (an older ``final`` is set aside first)."""
    _write_manifest(staging, fields)
    if final.exists():  # never replaced: the run directory's guard should have kept this from
        # happening (a damaged checkpoint a resume skipped is set aside then); keep it regardless
        kept = set_aside(final, "superseded")
        say(f"warning: a checkpoint '{final}' already existed: kept as '{kept}'", err=True)
    staging.rename(final)
    _fsync_dir(final.parent)
