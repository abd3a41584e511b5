"""Shapes for torch's CPU flash-attention kernels: calls padded to aligned lengths.

torch's CPU flash kernels in bf16 keep a compiled kernel for every block-tail shape they meet, so a
stream of ever-new lengths (documents of every size) grows the process by gigabytes (``python
bench/document_mask.py --tails``). Calls whose query and key lengths are multiples of
:data:`RUN_ALIGN` meet a handful of shapes. Padding goes after the real rows: under a causal mask no
real row sees it, and pad query rows are given no gradient and a log-sum-exp of +inf in backward,
so they add nothing to any gradient.
"""

from __future__ import annotations

import torch

RUN_ALIGN = 64
"""Rows a padded call's lengths are a multiple of."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`RUN_ALIGN`."""
    return -(-n // RUN_ALIGN) * RUN_ALIGN


def padded(t: torch.Tensor, m: int, value: float = 0.0) -> torch.Tensor:
    """(1, H, n, ...) -> (1, H, m, ...), rows of ``value`` after (``t`` itself when n == m)."""
    n = t.shape[2]
    if n == m:
        return t
    return torch.cat([t, t.new_full((*t.shape[:2], m - n, *t.shape[3:]), value)], dim=2)
