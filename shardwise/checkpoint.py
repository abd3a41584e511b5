"""Checkpoints that never lose work, on ``torch.distributed.checkpoint`` (DCP).

Layout: ``<run.dir>/checkpoints/step-<N>/`` holds the DCP files (every rank writes its own shards
of model, optimizer, LR scheduler, data position and step), ``rng-rank<R>.pt`` (each rank's RNG
state) and ``manifest.json`` (step, layout, model shape, and every file's size and SHA-256).

Atomic commit: a save is written into ``step-<N>.tmp``; once every rank's files are on disk and
fsynced, rank 0 writes the manifest into it and renames the directory to ``step-<N>``. A rename
is atomic, so a ``step-<N>`` directory is complete whatever moment a crash or ``kill -9`` hits;
leftover ``.tmp`` directories (and ``.deleting`` ones from retention) are skipped with a warning
and swept at the next save. Loading checks the manifest first: sizes always, checksums with
``checkpoint.verify_checksums`` (each rank hashes its share of the files).

Async save (``checkpoint.async_mode = thread | process``): the state is copied to host memory
before :meth:`Checkpointer.save` returns (so later steps cannot change what is saved), then
written and committed in the background on a dedicated gloo process group -- sharing the training
group with a background thread would interleave its collectives with training's.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardwise.config import CheckpointConfig, ConfigError
from shardwise.data.dataset import PackedLoader

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ASIDE = re.compile(r"\.(damaged|superseded)-\d{8}-\d{6}x*$")  # see set_aside()
_CHUNK = 8 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or loaded; the message names the file and the fix,
    ``reason`` says what is wrong in a few words (for a list of several checkpoints)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


# ---------------------------------------------------------------------------------------------
# Reading without running code. A checkpoint may come from someone else; unpickling can run any
# code it names. DCP itself reads its .metadata with plain pickle and non-tensor items (scheduler,
# data position, optimizer hyperparameters) with torch.load(weights_only=False): both go through
# the two classes below instead, which accept only what a DCP checkpoint holds.

# What a DCP .metadata file refers to (checked on torch 2.11-2.13): its dataclasses, torch.Size,
# dtypes, layouts and the path type of the writer.
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "ChunkStorageMetadata", "MetadataIndex",
                                              "_MEM_FORMAT_ENCODING", "BytesStorageMetadata",
                                              "StorageMeta", "TensorProperties", "TensorStorageMetadata"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _refused(path: Path, what: str, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint '{path}': {what} holds something other than tensors and plain "
                           f"values ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
                           "refused, since loading it could run code: use a checkpoint you trust",
                           f"has an unsafe {what}")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with ``.metadata`` unpickled against :data:`_DCP_GLOBALS` only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        file = Path(self.path) / ".metadata"
        try:
            with file.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise _refused(Path(self.path), ".metadata", e) from None
        except Exception as e:  # noqa: BLE001 - a truncated or garbled file: one line
            raise CheckpointError(f"checkpoint '{self.path}' has an unreadable .metadata "
                                  f"({type(e).__name__}): it was damaged; load an earlier step-<N>",
                                  "has an unreadable .metadata") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor items read by ``torch.load(weights_only=True)``."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(self.path, f"item '{read_item.dest_index.fqn}'", e) from None
        # Hand DCP the checked value the way it expects it: serialized (only plain values now).
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def _dcp_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` through :class:`SafeReader` and :class:`SafePlanner`; a refusal comes out as
    the one-line :class:`CheckpointError`, not wrapped in DCP's per-rank report."""
    SafeReader(str(path)).read_metadata()  # a refusal here as itself (DCP would turn it into text)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(path), no_dist=no_dist)
    except (Exception, CheckpointException) as e:
        ours = next((c for c in _causes(e) if isinstance(c, CheckpointError)), None)
        if ours is None:
            raise
        raise ours from None


def read_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of checkpoint ``path`` as a plain full tensor, in one process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = SafeReader(str(path)).read_metadata()
    state = {k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    _dcp_load({"model": state}, path, no_dist=True)
    return state


# ---------------------------------------------------------------------------------------------
# Finding and checking checkpoints (no process group needed)


def list_checkpoints(folder: Path, warn: bool = False) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``folder`` as (step, path), oldest first. With ``warn``, print
    one line for each leftover of an interrupted save or deletion (they are never loaded)."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
        elif warn and p.is_dir():
            why = ("kept aside, never loaded or deleted by shardwise: delete it when you no longer need it"
                   if _ASIDE.search(p.name) else
                   "not a complete checkpoint (an interrupted save or deletion; it is removed at the "
                   "next save)")
            print(f"warning: skipping '{p}': {why}", file=sys.stderr, flush=True)
    return sorted(found)


def set_aside(path: Path, why: str) -> Path:
    """Rename checkpoint ``path`` to ``<name>.<why>-<time>``: out of the way of the run (never loaded,
    never swept), and nothing deleted. Returns the new path."""
    aside = path.with_name(f"{path.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "x")
    path.rename(aside)
    return aside


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of checkpoint ``path``; a one-line error if it is missing or unreadable."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist: point checkpoint.path at a "
                              "step-<N> directory")
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"checkpoint '{path}' is incomplete (no {MANIFEST}: its save never "
                              "finished): point checkpoint.path at a complete step-<N> directory",
                              f"is incomplete (no {MANIFEST})")
    try:
        manifest = json.loads(file.read_text())
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint '{path}' has an unreadable {MANIFEST} ({e}): it was "
                              "damaged; load an earlier step-<N>", f"has an unreadable {MANIFEST}") from None
    return manifest


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_files(path: Path, manifest: dict[str, Any], names: list[str] | None = None,
                checksums: bool = True) -> str | None:
    """The first problem with the files ``names`` (default all) of checkpoint ``path`` as a one-line
    message, or None."""
    why = file_problem(path, manifest, names, checksums)
    return f"checkpoint '{path}' {why}: it was damaged; load an earlier step-<N>" if why else None


def file_problem(path: Path, manifest: dict[str, Any], names: list[str] | None = None,
                 checksums: bool = True) -> str | None:
    """What is wrong with the files ``names`` (default all) of ``path``, in a few words, or None."""
    files = manifest["files"]
    for name in files if names is None else names:
        want, f = files[name], path / name
        if not f.is_file():
            return f"is missing {name}"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"is truncated or altered: {name} has {size} bytes, the manifest says {want['bytes']}"
        if checksums and sha256(f) != want["sha256"]:
            return f"is corrupt: {name} does not match its SHA-256 in {MANIFEST}"
    return None


def problem(path: Path, checksums: bool = False) -> str:
    """What keeps checkpoint ``path`` from loading, in a few words ('' if nothing; sizes only
    unless ``checksums``)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return e.reason
    return file_problem(path, manifest, checksums=checksums) or ""


def looks_intact(path: Path) -> bool:
    """Manifest readable and every file of its recorded size (no hashing)."""
    try:
        return check_files(path, read_manifest(path), checksums=False) is None
    except CheckpointError:
        return False


def verify(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file of ``path`` against its manifest in this process; return the manifest."""
    manifest = read_manifest(path)
    if problem := check_files(path, manifest, checksums=checksums):
        raise CheckpointError(problem)
    return manifest


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor in checkpoint ``path`` (from DCP's metadata file)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = SafeReader(str(path)).read_metadata()
    return {k.removeprefix("model."): tuple(v.size) for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def check_compatible(path: Path, model: nn.Module) -> None:
    """One-line error naming the first parameter whose name or shape differs between checkpoint
    ``path`` and ``model`` (the full model, e.g. on meta) -- before DCP meets it mid-load."""
    saved = saved_shapes(path)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in ours.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint '{path}' has no parameter '{name}' (it was saved from a "
                                  "different model): use the model config it was saved with")
        if saved[name] != shape:
            raise CheckpointError(f"checkpoint '{path}': parameter '{name}' has shape {saved[name]} "
                                  f"there but {shape} in this model: use the model config it was saved "
                                  "with")
    if extra := sorted(set(saved) - set(ours)):
        raise CheckpointError(f"checkpoint '{path}' has parameter '{extra[0]}' that this model lacks "
                              f"({len(extra)} in all; saved from a different model): use the model config "
                              "it was saved with")


# Model-config fields that a checkpoint does not fix: the preset's label, the RoPE table's length
# (positions below both lengths rotate alike) and training-only weights of the balance terms.
# Every other field changes what the weights compute.
TRAINING_ONLY_FIELDS = ("name", "max_seq_len", "moe_aux_coef", "moe_bias_rate")


def check_same_function(path: Path, model_cfg: Any) -> None:
    """One-line error naming the first model-config field whose value makes this model compute a
    different function from the one checkpoint ``path`` was trained as (RoPE base and scaling,
    norm epsilon, head size, MoE scoring and routing, ...), with both values. Shapes are checked
    by :func:`check_compatible`; a manifest without a model config (an old one) is not checked."""
    saved = read_manifest(path).get("model")
    if not isinstance(saved, dict):
        return
    ours = dataclasses.asdict(model_cfg)
    for name, value in ours.items():
        if name in TRAINING_ONLY_FIELDS or name not in saved or saved[name] == value:
            continue
        if name == "moe_balance" and {saved[name], value} <= {"aux_loss", "none"}:
            continue  # an auxiliary loss shapes training only; "bias" adds routing state
        if isinstance(value, float) and isinstance(saved[name], (int, float)) and float(saved[name]) == value:
            continue
        raise CheckpointError(f"checkpoint '{path}' was trained with model.{name}={saved[name]!r}, this "
                              f"run has model.{name}={value!r}: the weights would compute a different "
                              f"function; pass --model.{name}={saved[name]} (or load another checkpoint)")


def model_only(path: Path) -> bool:
    """True for a weights-only checkpoint (e.g. ``shardwise convert --from-hf``): no optimizer."""
    return _weights_only(read_manifest(path))


def _weights_only(manifest: dict[str, Any]) -> bool:
    return manifest.get("contents") == ["model"]


# ---------------------------------------------------------------------------------------------
# What is saved


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


def _app_state(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, loader: PackedLoader,
               step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
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


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and everything inside it: causes, contexts, and DCP's per-rank failures."""
    out, todo = [], [e]
    while todo:
        cur = todo.pop()
        out.append(cur)
        failures = getattr(cur, "failures", None)  # DCP's CheckpointException: rank -> (exception,
        if isinstance(failures, dict):  # traceback), or the exception itself in older versions
            for v in failures.values():
                v = v[0] if isinstance(v, tuple) and v else v
                if isinstance(v, BaseException):
                    todo.append(v)
        todo.extend(x for x in (cur.__cause__, cur.__context__) if x is not None)
    return out


def _errno(e: BaseException) -> int | None:
    return next((c.errno for c in _causes(e) if isinstance(c, OSError) and c.errno is not None), None)


def _reason(e: BaseException) -> str:
    """The OS-level cause inside a (possibly DCP-wrapped) save failure, as one short phrase."""
    for c in _causes(e):
        if isinstance(c, OSError) and c.errno is not None:
            return f"{os.strerror(c.errno)}" + (f" ({c.filename})" if c.filename else "")
    inner = _causes(e)[-1]
    return f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"


# ---------------------------------------------------------------------------------------------
# Saving


class Checkpointer:
    """Saves (sync or async) and commits checkpoints under ``folder``; collective over all ranks.

    ``info`` (layout, model config) goes into each manifest. ``group``: a gloo group over every rank
    used by nothing else (created here when not given; every rank must then create it at the same
    point)."""

    def __init__(self, folder: Path, cfg: CheckpointConfig, info: dict[str, Any],
                 group: dist.ProcessGroup | None = None) -> None:
        self.folder, self.cfg, self.info = folder, cfg, info
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._executor = ThreadPoolExecutor(1, "shardwise-ckpt") if cfg.async_mode != "none" else None
        self._pending: Future | None = None
        self._local_error: str | None = None
        self.blocked_s = 0.0  # how long the last save() held up training

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
                for p in self.folder.iterdir():  # leftovers of interrupted saves/deletions
                    if p.name.endswith((".tmp", ".deleting")):
                        shutil.rmtree(p, ignore_errors=True)
                staging.mkdir()
            except OSError as e:
                status[0] = self._failed(step, e)
        dist.broadcast_object_list(status, src=0, group=self.group)
        if status[0]:
            raise CheckpointError(status[0])
        state = _app_state(model, optimizer, scheduler, loader, step)
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
        for old in retired(list_checkpoints(self.folder), step, self.cfg.keep_latest_k):
            try:
                _remove(old)
            except OSError as e:  # the new checkpoint is committed; an old one lingering is harmless
                print(f"warning: could not delete old checkpoint '{old}': {e}", file=sys.stderr)


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
    """Write a weights-only checkpoint from one process (``shardwise convert --from-hf``), committed
    the same way: staging directory, manifest with checksums, rename."""
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    dcp.save({"model": state}, checkpoint_id=str(staging), no_dist=True)
    files = {p.name: _file_record(p) for p in sorted(staging.iterdir())}
    _commit(staging, path, {"step": 0, "world_size": 1, "contents": ["model"], **info, "files": files})


def _commit(staging: Path, final: Path, fields: dict[str, Any]) -> None:
    """Write the manifest into ``staging`` (temporary name, fsync, rename), then make ``staging``
    the complete checkpoint ``final`` with one rename (an older ``final`` is removed first)."""
    manifest = {"format": FORMAT, "created": time.time(), "torch": torch.__version__, **fields}
    tmp = staging / (MANIFEST + ".part")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(staging / MANIFEST)
    _fsync_dir(staging)
    if final.exists():  # never replaced: the run directory's guard should have kept this from
        # happening (a damaged checkpoint a resume skipped is set aside then); keep it regardless
        kept = set_aside(final, "superseded")
        print(f"warning: a checkpoint '{final}' already existed: kept as '{kept}'", file=sys.stderr)
    staging.rename(final)
    _fsync_dir(final.parent)


def load_model_only(path: Path, model: nn.Module) -> None:
    """Load just the weights of checkpoint ``path`` into a plain (unparallelized) ``model``."""
    state = {"model": model.state_dict()}
    _dcp_load(state, path, no_dist=True)
    model.load_state_dict(state["model"])


# ---------------------------------------------------------------------------------------------
# Loading


def verify_distributed(path: Path, checksums: bool) -> dict[str, Any]:
    """Every rank checks its share of ``path``'s files; all raise the same error on any problem."""
    manifest = read_manifest(path)
    names = sorted(manifest["files"])[dist.get_rank()::dist.get_world_size()]
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, file_problem(path, manifest, names, checksums))
    if bad := [p for p in problems if p]:
        raise CheckpointError(f"checkpoint '{path}' {bad[0]}: it was damaged; load an earlier step-<N>",
                              bad[0])
    return manifest


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LambdaLR, loader: PackedLoader,
         checksums: bool = True) -> int:
    """Restore everything saved by :meth:`Checkpointer.save` in place; returns the checkpoint's
    step. A weights-only checkpoint restores the model and returns 0 (fresh optimizer and data)."""
    manifest = verify_distributed(path, checksums)
    if _weights_only(manifest):
        state = {"model": get_model_state_dict(model)}
        _dcp_load(state, path)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        return 0
    state = _app_state(model, optimizer, scheduler, loader, step=0)
    _dcp_load(state, path)
    # Hyperparameters come from this run's config, state from the checkpoint: the optimizer state
    # dict would otherwise bring back the saved lr / betas / weight decay, and the scheduler its
    # base LRs, silently overriding what the user asked for.
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    for group, h in zip(optimizer.param_groups, hyper, strict=True):
        group.update(h)
    saved = state["lr_scheduler"]
    scheduler.last_epoch, scheduler._step_count = saved["last_epoch"], saved["_step_count"]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas,
                                                               strict=True)]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
    loader.load_state_dict(state["dataloader"])
    rng_file = path / f"rng-rank{dist.get_rank()}.pt"
    # Same world size: each rank continues its own random streams. Resharded: there is no
    # one-to-one map of ranks, so every rank keeps the seeded state (documented).
    if manifest.get("world_size") == dist.get_world_size() and rng_file.is_file():
        try:
            saved_rng = torch.load(rng_file, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(path, rng_file.name, e) from None
        set_rng_state(saved_rng)
    return int(state["train"]["step"])
