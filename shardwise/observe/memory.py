"""Per-rank memory: the CUDA allocator's peak on GPUs, the process RSS high-water mark on CPU."""

from __future__ import annotations

import resource
import sys

import torch

GiB = 1024**3


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GiB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / GiB  # Linux reports KiB
