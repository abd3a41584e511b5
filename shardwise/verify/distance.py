"""How far a layout's trained weights ended from the reference's, in units of how far training moved
them: the one measure ``verify`` compares every layout by, real or simulated."""

from __future__ import annotations

import math

import torch


def tensor_update_error(p: torch.Tensor, p_ref: torch.Tensor, p_start: torch.Tensor) -> float:
    """||p - p_ref|| / ||p_ref - p_start||, each element's difference less one unit in the last place
    of its reference value: two runs whose exact weights agree can still be stored one float apart,
    and a weight near 1 that training moved by 7e-4 cannot be held closer than 1.6e-4 of its move."""
    gap, moved = update_sums(p, p_ref, p_start)
    return math.sqrt(gap.item()) / max(math.sqrt(moved.item()), 1e-30)


def update_sums(p: torch.Tensor, p_ref: torch.Tensor, p_start: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two squared norms of :func:`tensor_update_error` (float64 scalars): they add over the
    pieces of a sharded tensor."""
    ref = p_ref.float()
    ulp = torch.nextafter(ref.abs(), torch.full_like(ref, math.inf)) - ref.abs()
    gap = ((p.float() - ref).abs() - ulp).clamp(min=0)
    return gap.double().square().sum(), (ref - p_start.float()).double().square().sum()
