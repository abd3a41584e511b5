"""What ``torch.autocast`` leaves to hand-written code: the products it does not cover (grouped
GEMMs, the fused loss's custom autograd functions) cast by hand to the dtype it would use. On in a
one-rank run without FSDP (parallel/fsdp.py ``apply_autocast``)."""

from __future__ import annotations

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype for products on ``x``'s device where it is on there, else None."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product on ``x`` runs in: autocast's where it is on, else ``x``'s own."""
    return autocast_dtype(x) or x.dtype
