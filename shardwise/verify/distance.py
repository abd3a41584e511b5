"""How far a layout's trained weights ended from the reference's, in units of how far training moved
them: the one measure ``verify`` compares every layout by, real or simulated."""

from __future__ import annotations

import math

import torch


def tensor_update_error(p: torch.Tensor, p_ref: torch.Tensor, p_start: torch.Tensor) -> float:
    """||p - p_ref|| / ||p_ref - p_start||, each element's difference less one unit in the last place
    of its reference value: two runs whose exact weights agree can still be stored one float apart,
    and a weight near 1 that training moved by 7e-4 cannot be held closer than 1.6e-4 of its move."""
    ref = p_ref.float()
    ulp = torch.nextafter(ref.abs(), torch.full_like(ref, math.inf)) - ref.abs()
    gap = ((p.float() - ref).abs() - ulp).clamp(min=0)
    return (gap.norm() / (ref - p_start.float()).norm().clamp(min=1e-30)).item()
