"""Loading checkpoints -- and reading one never runs code from it.

A checkpoint may come from someone else, and unpickling can run any code it names. DCP itself reads
its ``.metadata`` with plain pickle and its non-tensor items (scheduler, data position, optimizer
hyperparameters) with ``torch.load(weights_only=False)``: both go through :class:`SafeReader` and
:class:`SafePlanner` instead, which accept only what a DCP checkpoint holds.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardwise.checkpoint.manifest import (
    CheckpointError,
    exception_chain,
    file_problem,
    is_weights_only,
    read_manifest,
    verify,
)
from shardwise.checkpoint.saver import app_state, set_rng_state
from shardwise.data.dataset import PackedLoader
from shardwise.models.lora import is_adapter

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
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            rel = str(getattr(info, "relative_path", ""))
            if not rel or rel.startswith(("/", "\\")) or ".." in Path(rel).parts or Path(rel).name != rel:
                raise CheckpointError(f"checkpoint '{self.path}': its .metadata points at '{rel[:80]}', "
                                      "outside the checkpoint folder: refused; use a checkpoint you trust",
                                      "has a .metadata pointing outside it")
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
        with warnings.catch_warnings():  # (no_dist: DCP warns that it assumes one process, as asked)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(path), no_dist=no_dist)
    except (Exception, CheckpointException) as e:
        ours = next((c for c in exception_chain(e) if isinstance(c, CheckpointError)), None)
        if ours is None:
            raise
        raise ours from None


def read_model_tensors(path: Path, checksums: bool = True) -> dict[str, torch.Tensor]:
    """Every model tensor of checkpoint ``path`` as a plain full tensor, in one process (its files
    checked against the manifest first)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify(path, checksums)
    meta = SafeReader(str(path)).read_metadata()
    state = {k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    _dcp_load({"model": state}, path, no_dist=True)
    return state


class ModelTensors:
    """Checkpoint ``path``'s model tensors read one at a time (each a plain full tensor): what
    ``convert --to-hf`` streams from, holding one tensor of the model at a time, not all of it. The
    files are checked against the manifest first (``checksums``: their SHA-256 too)."""

    def __init__(self, path: Path, checksums: bool = True) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        verify(path, checksums)
        self.path = path
        meta = SafeReader(str(path)).read_metadata()
        self.specs = {k.removeprefix("model."): (tuple(v.size), v.properties.dtype)
                      for k, v in meta.state_dict_metadata.items()
                      if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self.specs[name]
        state = {name: torch.empty(shape, dtype=dtype)}
        _dcp_load({"model": state}, self.path, no_dist=True)
        return state[name]


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


def load_model_only(path: Path, model: nn.Module, checksums: bool = True) -> None:
    """Load just the weights of checkpoint ``path`` into a plain (unparallelized) ``model``, its files
    checked against the manifest first (``checksums``: their SHA-256 too)."""
    verify(path, checksums)
    state = {"model": model.state_dict()}
    _dcp_load(state, path, no_dist=True)
    model.load_state_dict(state["model"])


def load_weights(path: Path, model: nn.Module, checksums: bool = True) -> None:
    """Only the model weights of checkpoint ``path`` (a full or a weights-only one) into ``model``,
    parallelized in any layout (each rank reads its shards); the files are verified first."""
    verify_distributed(path, checksums)
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


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
    base_for_lora = manifest.get("lora") is None and any(is_adapter(n) for n, _ in model.named_parameters())
    if is_weights_only(manifest) or base_for_lora:  # (a base for LoRA: its weights, fresh adapters)
        state = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
        _dcp_load({"model": state}, path)
        set_model_state_dict(model, state, options=StateDictOptions(strict=not base_for_lora))
        return 0
    state = app_state(model, optimizer, scheduler, loader, step=0)
    # Hyperparameters come from this run's config, state from the checkpoint: only the optimizer's
    # per-parameter state (keyed by parameter name) is read, and its groups stay this run's own --
    # the saved ones would bring back the saved lr / betas / weight decay, and would have to match
    # this run's grouping (model.moe_router_lr_scale gives the routers a group of their own). The
    # scheduler's base LRs are likewise this run's; only its position is read.
    groups = state["optimizer"].pop("param_groups")
    _dcp_load(state, path)
    state["optimizer"]["param_groups"] = groups
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
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
