"""Gradient clipping by the true global norm of gradients that are sharded over mesh dims."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    stage_group: dist.ProcessGroup | None = None,
                    optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm.

    The scaling is one division by :func:`clip_divisor`: in place here, or -- given an
    ``optimizer`` that takes it (torch's fused AdamW: :func:`folds_grad_scale`) -- inside that
    optimizer's kernel at its next step, which saves a read and a write of every gradient and gives
    the same bits (the kernel divides too).

    Local squared norms are summed per (mesh, dims the gradient is sharded on); each such group is
    all-reduced once over those dims only -- replicated dims hold copies and must not be counted
    twice. With FSDP that is one all-reduce per step, not one per parameter. ``max_norm <= 0``
    only measures. ``stage_group`` (pipeline parallel) sums the squared norm over the stages, whose
    ranks hold different parameters.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    locals_: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            sharded = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key = (g.device_mesh, sharded)
            g = g.to_local()
        else:
            key = (None, ())
        groups[key].append(g)
        locals_.append(g)
    # Accumulate in float64: a one-pass fp32 sum of ~1e5 squares is off by ~1e-5 relative, enough
    # to make the reported norm depend on how the gradients happen to be sharded.
    device = locals_[0].device if locals_ else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for (mesh, dims), tensors in groups.items():
        sq = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64)).square().sum()
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(d))  # sum of squares over the shards
        total_sq += sq
    if stage_group is not None:
        dist.all_reduce(total_sq, group=stage_group)  # all-reduce over pp: stages hold disjoint params
    total = total_sq.sqrt().float()
    if max_norm > 0 and locals_:
        if optimizer is not None and folds_grad_scale(optimizer):
            optimizer.grad_scale = clip_divisor(total, max_norm)  # (read once by its step)
        else:
            torch._foreach_div_(locals_, clip_divisor(total, max_norm))
    return total


def clip_divisor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradients are divided by: norm / max_norm, at least 1 (never scaled up)."""
    return torch.clamp((total_norm + 1e-6) / max_norm, min=1.0)


def folds_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """True for torch's fused Adam/AdamW, whose step divides every gradient by
    ``optimizer.grad_scale`` in its kernel (the hook torch's GradScaler uses)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(
        optimizer.defaults.get("fused"))
