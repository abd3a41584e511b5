"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

Layout: ``<run.dir>/checkpoints/step-<N>/`` holds the DCP files (model, optimizer, LR scheduler,
data position, step) plus ``rng-rank<R>.pt`` (each rank's RNG state). A save is written into
``step-<N>.tmp`` and renamed to ``step-<N>`` by rank 0 only after every rank has finished, so a
directory named ``step-<N>`` is always complete; leftovers of an interrupted save are ignored.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardwise.config import ConfigError
from shardwise.data.dataset import PackedLoader

_STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``folder`` as (step, path), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
    return sorted(found)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
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


def save(folder: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, loader: PackedLoader) -> Path:
    """Write ``folder/step-<step>``; collective over all ranks."""
    final, staging = folder / f"step-{step}", folder / f"step-{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    dcp.save(_app_state(model, optimizer, scheduler, loader, step), checkpoint_id=str(staging))
    torch.save(rng_state(), staging / f"rng-rank{rank}.pt")
    dist.barrier()  # every rank's files are on disk before the directory becomes visible
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    dist.barrier()
    return final


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LambdaLR, loader: PackedLoader) -> int:
    """Restore everything saved by :func:`save` in place; returns the checkpoint's step."""
    if not (path / ".metadata").is_file():
        raise ConfigError(f"checkpoint '{path}' is not a complete checkpoint (no .metadata): point "
                          "checkpoint.path at a step-<N> directory")
    state = _app_state(model, optimizer, scheduler, loader, step=0)
    dcp.load(state, checkpoint_id=str(path))
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
    if rng_file.is_file():  # absent when resuming on more ranks than saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return int(state["train"]["step"])
