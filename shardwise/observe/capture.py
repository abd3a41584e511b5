"""Where a layout first departs from the one-rank run: full module outputs and gradients of one
step, captured on every rank and compared in execution order (``verify --localize``).

**Capture** (``--debug.capture DIR`` at ``debug.trace_step``): each rank saves

- every forward output shaped like the residual stream -- (batch, sequence, model dim): the
  embedding, each block, each block's norms, attention and feed-forward, the final norm; not a
  checkpointed block's recompute inside backward -- as its own local tensor, with the global rows
  of the micro-batch it belongs to (the loader's ``first_row``) and the global sequence positions
  it holds (context parallel's load-balanced chunks, then sequence parallel's share of them).
  Every layout shards these tensors only by batch (data parallel), by sequence (context and
  sequence parallel) and by stage (pipeline), so the full tensor is reassembled from the ranks'
  pieces by their rows and positions, never by their layout;
- every parameter's gradient as the optimizer is about to use it, gathered to the full tensor
  (one rank per pipeline stage writes them), with the mesh dims that shard it.

**Localize** (:func:`localize`): the layout's reassembled outputs against the reference's, in the
order the reference ran its modules, then the gradients in backward order (the last layer's
first); the first one whose relative L2 difference exceeds the precision's tolerance is named,
with the mesh dims that split it and the next two that follow.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.schema import ConfigError
from shardwise.parallel.context import local_positions
from shardwise.parallel.dims import Mesh, ParallelDims

TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
"""Relative L2 difference of one module output or gradient, at the first step from one seed, above
which it differs. Correct layouts differ by summation order only. Measured on the tiny models of
tests/e2e/test_localize.py: fp32, every layout of the fp32 parity matrix (51: dense, masked and not,
MoE, Qwen3, the multi-stage schedules), at most 7.0e-7 over every output and gradient; bf16, FSDP 2,
TP 2, PP 2, CP 2, TP 2 x FSDP 2, MoE FSDP 2 x EP 2 and TP 2 x EP 2, at most 6.3e-3. The five planted
bugs there differ by 0.47 to 1.4."""


class StepCapture:
    """This rank's capture of one step (see the module docstring)."""

    def __init__(self, out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims,
                 seq_len: int, dim: int, load_balance: bool, rank: int) -> None:
        self.out, self.rank, self.dim = out, rank, dim
        self._place(dims, seq_len, load_balance)
        self.model, self.active, self.rows = model, False, []
        self.outputs: list[tuple[str, int, torch.Tensor]] = []
        self.grads: dict[str, tuple[torch.Tensor, str]] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n]
        self.handles.append(optimizer.register_step_pre_hook(self._grads))
        self.calls: dict[str, int] = {}

    def _place(self, dims: ParallelDims, seq_len: int, load_balance: bool) -> None:
        """This rank's sequence positions, and whether it writes the gradients."""
        positions = torch.arange(seq_len)
        if dims.cp > 1:
            positions = local_positions(seq_len, dims.submesh(Mesh.CP), load_balance).cpu()
        if dims.tp > 1:  # sequence parallel: a contiguous share of this cp rank's positions
            positions = positions.chunk(dims.tp)[dims.mesh[Mesh.TP].get_local_rank()]
        self.positions = positions
        coords = [dims.mesh[d].get_local_rank()
                  for d in (Mesh.DP_REPLICATE, Mesh.DP_SHARD, Mesh.CP, Mesh.TP)]
        self.writes_grads = not any(coords)  # one rank of each pipeline stage

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        """What is kept of a captured tensor (a plain fp32 CPU copy)."""
        return plain_copy(t)

    def _hook(self, name: str):  # noqa: ANN202 - a forward hook
        def record(module: nn.Module, args: Any, out: Any) -> None:
            if (not self.active or not isinstance(out, torch.Tensor) or not torch.is_grad_enabled()
                    or getattr(self.model, "placeholder", False)  # (a pipeline's shape inference)
                    or torch._C._current_graph_task_id() != -1):  # (a checkpointed block's recompute)
                return
            local = out.to_local() if isinstance(out, DTensor) else out
            if local.dim() != 3 or local.shape[1:] != (len(self.positions), self.dim):
                return  # not the residual stream's pieces (heads, hidden, logits, gathered inputs)
            call = self.calls[name] = self.calls.get(name, -1) + 1
            self.outputs.append((name, call, self._keep(local)))
        return record

    def _grads(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad
            dims = ""
            if isinstance(g, DTensor):  # (a collective: every rank holding the parameter joins)
                mesh = g.device_mesh
                dims = ",".join(n for n, pl in zip(mesh.mesh_dim_names or (), g.placements, strict=True)
                                if pl.is_shard() and mesh[n].size() > 1)
                g = g.full_tensor()
            if self.writes_grads:
                self.grads[name] = (self._keep(g), dims)

    @contextlib.contextmanager
    def around_step(self, batches: list) -> Iterator[None]:
        """Capture the step these micro-batches (their global rows) run."""
        self.active, self.calls, self.outputs, self.grads = True, {}, [], {}
        self.rows = [(b.first_row, b.inputs.shape[0]) for b in batches]
        try:
            yield
        finally:
            self.active = False
        self.out.mkdir(parents=True, exist_ok=True)
        self._save()

    def _save(self) -> None:
        torch.save({"rows": self.rows, "positions": self.positions, "outputs": self.outputs,
                    "grads": self.grads}, self.out / f"rank{self.rank}.pt")

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# Localize


@dataclass(frozen=True)
class Mismatch:
    kind: str
    """``output`` or ``gradient``."""
    name: str
    rel: float
    split: str
    """The mesh dims that split it in the layout."""


def plain_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 CPU copy as a plain tensor: a collective's pending result (functional
    collectives' ``AsyncCollectiveTensor``) is waited for and unwrapped, so the file holds tensors
    only and loads with ``weights_only``."""
    if hasattr(t, "trigger_wait"):
        t = t.trigger_wait()
    return t.detach().float().cpu().as_subclass(torch.Tensor)


def _load_capture(path: Path) -> dict:
    """One rank's capture: tensors, numbers, strings and containers only (``weights_only``: a file
    that names anything else -- code to run on unpickling -- is refused in one line)."""
    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ConfigError(f"capture '{path}' is not a capture shardwise wrote ({first}): refused, since "
                          "loading it could run code; capture the runs again") from None


def _assemble(ranks: list[dict]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Full outputs by module name (from every rank's pieces, by rows and positions), in the order
    the first rank to hold each ran them."""
    full: dict[str, torch.Tensor] = {}
    order: list[str] = []
    rows = max(first + n for r in ranks for first, n in r["rows"])
    seq = max(int(r["positions"].max()) for r in ranks) + 1
    for r in ranks:
        for name, call, local in r["outputs"]:
            if name not in full:
                full[name] = torch.full((rows, seq, local.shape[-1]), float("nan"))
                order.append(name)
            first, n = r["rows"][call]
            full[name][first:first + n, r["positions"]] = local
    return full, order


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or torch.isnan(a).any():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


LOST = "held by no rank"
"""A :class:`Mismatch`'s ``split`` where the layout has no such module at all."""


def _lost(module: str, ref_grads: dict, lay_grads: dict) -> bool:
    """Whether the reference's ``module`` has parameters and the layout holds none of them."""
    own = module + "."
    return any(k.startswith(own) for k in ref_grads) and not any(k.startswith(own) for k in lay_grads)


def localize(reference: Path, layout: Path, precision: str, sharded: str) -> tuple[list[Mismatch], float]:
    """The outputs, then (if they all agree) the gradients, of ``layout``'s capture that differ from
    ``reference``'s beyond the precision's tolerance, first one first; and the largest relative
    difference of all those compared. ``sharded``: the mesh dims that split the residual stream in
    the layout (batch and sequence), for the report."""
    tol = TOLERANCE[precision]
    ref = [_load_capture(p) for p in sorted(reference.glob("rank*.pt"))]
    lay = [_load_capture(p) for p in sorted(layout.glob("rank*.pt"))]
    ref_out, order = _assemble(ref)
    lay_out, _ = _assemble(lay)
    ref_grads = {k: v for r in ref for k, v in r["grads"].items()}
    lay_grads = {k: v for r in lay for k, v in r["grads"].items()}
    # (a module whose output is not residual-shaped in the layout -- a projection split over tp --
    # is not compared; the region around it is. One whose parameters no rank holds either -- a block
    # a pipeline split lost -- differs.)
    outputs = [Mismatch("output", n, _rel(lay_out[n], ref_out[n]), sharded) if n in lay_out else
               Mismatch("output", n, math.inf, LOST)
               for n in order if n in lay_out or _lost(n, ref_grads, lay_grads)]
    if found := [m for m in outputs if m.rel > tol]:
        return found, max(m.rel for m in outputs)
    missing = (torch.empty(0), "?")  # (a gradient the layout did not write: differs)
    grads = [Mismatch("gradient", n, _rel(lay_grads.get(n, missing)[0], ref_grads[n][0]),
                      lay_grads.get(n, missing)[1]) for n in reversed(list(ref_grads))]
    return [m for m in grads if m.rel > tol], max(m.rel for m in outputs + grads)


def format_localized(name: str, found: list[Mismatch], worst: float, precision: str, failed: bool) -> str:
    """One screen: the first differing output or gradient, and the next two."""
    tol = TOLERANCE[precision]
    if not found:
        where = ": the difference arises in the update or in a later step" if failed else ""
        return (f"{name}: every module output and gradient of step 1 agrees within {tol:g} (largest "
                f"relative difference {worst:.1e}){where}")
    first = found[0]
    lines = [f"{name}: first difference at the {first.kind} of {first.name}: relative {first.rel:.2e} "
             f"(tolerance {tol:g}); " + (LOST if first.split == LOST else
                                         f"split over {first.split or 'nothing (replicated)'}")]
    lines += [f"  then {m.kind} of {m.name}: {m.rel:.2e}" for m in found[1:3]]
    return "\n".join(lines)
