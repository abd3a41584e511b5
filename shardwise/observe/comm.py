"""Collectives of one training step, per module and mesh dim, with the bytes they move.

Built on torch's ``CommDebugMode``, which sees both DTensor collectives (TP, loss parallel) and the
c10d collectives FSDP2 issues. It counts calls; :class:`CommTracker` adds, for every call, the
*buffer bytes*: the size of the largest tensor among the collective's inputs and outputs (the
gathered tensor of an all-gather, the unreduced tensor of a reduce-scatter, the tensor of an
all-reduce). On a ring, each rank sends and receives about ``(n - 1) / n`` of that.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.config.notice import say

# c10d op names -> the collective they are (FSDP2 uses the c10d base ops directly).
_CANONICAL = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "allreduce_": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "broadcast_": "broadcast",
    "broadcast": "broadcast", "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",  # pipeline stages' point-to-point
}


def _group_name(args: tuple) -> str | None:
    """c10d ops carry the ProcessGroup as a script object; functional collectives pass the group
    name as their last string argument (earlier strings are reduce ops such as 'sum')."""
    leaves = tree_leaves(args)
    for a in leaves:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:
                continue
    names = [a for a in leaves if isinstance(a, str)]
    return names[-1] if names else None


class CommTracker(CommDebugMode):
    """``CommDebugMode`` that also records (module, phase, collective, group) -> calls and bytes."""

    def __init__(self, group_names: dict[str, str] | None = None, track_modules: bool = True) -> None:
        super().__init__()
        self.group_names, self.track_modules = group_names or {}, track_modules
        self.records: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        # torch's module tracker adds a post-forward hook at every forward of a module without
        # removing the previous one, so a module's second forward in one step (gradient
        # accumulation) pops its parent twice and fails. Drop the old hook first.
        tracker = self.advanced_module_tracker
        pre_hook = tracker._fw_pre_hook

        def fw_pre_hook(mod: torch.nn.Module, inputs: Any) -> None:
            if not tracker.is_bw:
                old = tracker.register_forward_hook_handles.pop(tracker._get_mod_name(mod), None)
                if old is not None:
                    old.remove()
            pre_hook(mod, inputs)
        tracker._fw_pre_hook = fw_pre_hook

    def __enter__(self) -> CommTracker:
        if self.track_modules:
            return super().__enter__()
        # Without module tracking: its hooks cannot run under torch.autograd.grad, which pipeline
        # stages use for their backward. Collectives are then counted for the step as a whole.
        self.comm_module_counts["Global"] = {"forward": defaultdict(int), "backward": defaultdict(int)}
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args: Any) -> None:
        if self.track_modules:
            return super().__exit__(*args)
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.track_modules:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        elif isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        elif any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, then see those
        else:
            out = func(*args, **(kwargs or {}))
        if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
            return out
        kind = _CANONICAL.get(func._overloadpacket.__name__)
        if kind is None or not func.namespace.startswith(("c10d", "_c10d")):
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = max((_first_rank(t.numel()) * t.element_size() for t in tensors), default=0)
        group = self.group_names.get(_group_name(args) or "", _group_name(args) or "?")
        if self.track_modules:
            module = self.advanced_module_tracker.name
            phase = "backward" if self.advanced_module_tracker.is_bw else "forward"
        else:
            module, phase = "(pipeline stage)", "step"
        rec = self.records[(module, phase, kind, group)]
        rec[0] += 1
        rec[1] += nbytes
        return out

    def summary(self) -> list[dict[str, Any]]:
        """One row per (module, phase, collective, mesh dim), in call order."""
        return [{"module": m, "phase": p, "collective": c, "mesh_dim": g, "calls": n, "bytes": b}
                for (m, p, c, g), (n, b) in self.records.items()]

    def totals(self) -> dict[str, dict[str, int]]:
        """Bytes per mesh dim and collective over the whole step."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for (_, _, c, g), (_, b) in self.records.items():
            out[g][c] += b
        return {g: dict(v) for g, v in out.items()}


def _first_rank(n: int | torch.SymInt) -> int:
    """A size; on simulated ranks, where sizes differ by rank (an uneven all-to-all's), the first
    simulated rank's: the tracker counts one rank's collectives."""
    ints = getattr(getattr(n, "node", None), "_local_ints", None)  # (LocalTensorMode's per-rank int)
    return ints[min(ints)] if ints else int(n)


def mesh_group_names(mesh: DeviceMesh, flat: dict[str, DeviceMesh]) -> dict[str, str]:
    """Process-group name -> mesh dim name, for the world mesh's dims and the flattened views."""
    names = {}
    for dim in mesh.mesh_dim_names or ():
        names[mesh.get_group(dim).group_name] = dim
    for dim, sub in flat.items():
        if sub.ndim == 1:
            names.setdefault(sub.get_group().group_name, dim)
            continue
        for sub_dim in sub.mesh_dim_names or ():  # a 2-D view (HSDP with cp): name its own dims
            names.setdefault(sub.get_group(sub_dim).group_name, sub_dim)
    return names


def format_comm(rows: list[dict[str, Any]], totals: dict[str, dict[str, int]]) -> str:
    lines = ["| module | phase | collective | mesh dim | calls | MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['module']} | {r['phase']} | {r['collective']} | {r['mesh_dim']} | "
                     f"{r['calls']} | {r['bytes'] / 2**20:.3f} |")
    lines += ["", "| mesh dim | collective | MiB per step |", "|---|---|---|"]
    for g, per in totals.items():
        for c, b in per.items():
            lines.append(f"| {g} | {c} | {b / 2**20:.3f} |")
    return "\n".join(lines)


@contextlib.contextmanager
def trace_step(enabled: bool, mesh: DeviceMesh, flat: dict[str, DeviceMesh], out: Path,
               rank: int, track_modules: bool = True) -> Iterator[None]:
    """Record the collectives of the wrapped step; rank 0 prints the table and writes ``out``.
    ``track_modules=False`` (pipeline parallel) attributes them to the step, not to modules."""
    if not enabled:
        yield
        return
    tracker = CommTracker(mesh_group_names(mesh, flat), track_modules)
    with tracker, warnings.catch_warnings():
        # Artifacts of tracing, not of training: under a dispatch mode F.linear decomposes into mm +
        # a real view (FSDP2 then warns about the root returning a view; nothing modifies the logits
        # in place), and the module tracker's own full backward hooks warn about themselves.
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        warnings.filterwarnings("ignore", message="Full backward hook is firing.*")
        yield
    if rank == 0:
        rows, totals = tracker.summary(), tracker.totals()
        out.write_text(json.dumps({"rows": rows, "totals": totals}, indent=1))
        say(f"collectives of one step on rank 0 (--debug.comm; also in {out}):\n"
            + format_comm(rows, totals))
