"""Per-rank memory: the CUDA allocator's peak on GPUs, the process RSS high-water mark on CPU;
a breakdown at the first step -- parameters, gradients and optimizer states counted from the
tensors, activations as the bytes autograd saves for backward; and on request (``debug.memory``)
the live-tensor peak of one step, by category, from torch's MemTracker."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.observe.metrics import per_rank

GiB = 1024**3


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GiB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / GiB  # Linux reports KiB


def peak_reserved_gib(device: torch.device) -> dict[str, float]:
    """On CUDA, what the caching allocator has reserved at most (``memory_reserved_gib``: the figure
    an out-of-memory error is about, allocated bytes plus the allocator's rounding and free cached
    blocks) and how often it had to free its cache and retry an allocation
    (``alloc_retries``: above 0, the run is at the edge of the device's memory). Nothing on CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"memory_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GiB,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def current_memory_gib(device: torch.device) -> float:
    """Memory in use now: the CUDA allocator's allocated bytes, or the process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GiB
    try:
        resident_pages = int(open("/proc/self/statm").read().split()[1])
    except OSError:  # not Linux: fall back to the high-water mark
        return peak_memory_gib(device)
    return resident_pages * resource.getpagesize() / GiB


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for ``tensors`` (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer states held by this rank (exact, from the tensors)."""
    params = list(model.parameters())
    states = [v for st in optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.numel() > 1]  # Adam's 1-element step counters aside
    return {"params": local_bytes(params),
            "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": local_bytes(states)}


class SavedActivations:
    """Counts the bytes autograd saves for backward inside the ``with`` block (unique storages;
    parameters and views of them -- including FSDP's gathered ones -- are not activations)."""

    def __init__(self) -> None:
        self._storages: dict[object, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.device.type != "meta":
                try:
                    storage = local.untyped_storage()
                    self._storages[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError):  # a wrapper without a real storage
                    # (e.g. an in-flight collective's result): count the tensor itself
                    self._storages[("tensor", id(local))] = local.numel() * local.element_size()
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


@contextlib.contextmanager
def track_peak(enabled: bool, model: nn.Module, optimizer: torch.optim.Optimizer, out: Path,
               device: torch.device) -> Iterator[None]:
    """Record the peak of live tensor bytes inside the block on every rank with torch's
    ``MemTracker`` (what a caching allocator would have to hold, without its rounding or cache;
    parameters, gradients, optimizer states, activations and temporaries told apart). Rank 0 writes
    every rank's peak and its breakdown to ``out`` (every rank must enter)."""
    if not enabled:
        yield
        return
    tracker = _StepMemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        yield
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = next((v for d, v in snapshot.items() if torch.device(d).type == device.type), {})
    breakdown = {str(k).rsplit(".", 1)[-1].lower(): v / GiB for k, v in per_device.items()}
    table = per_rank(breakdown, device)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(table, indent=1))


def _step_mem_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        """MemTracker over a whole step: a module may run forward once per micro-batch (gradient
        accumulation, pipeline schedules). Its per-module statistics restart at each forward; the
        step's peak, which is all this is read for, is kept across them."""

        def _pre_fw_hook(self, module: nn.Module, inputs: object) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return StepMemTracker


def _StepMemTracker():  # noqa: N802 -- torch's tools are imported only when tracing is on
    return _step_mem_tracker_class()()
