"""Learning-rate schedules: linear warmup, then cosine / linear / warmup-stable-decay / constant."""

from __future__ import annotations

import math

import torch

from shardwise.config.schema import LRSchedulerConfig


class WarmupDecay:
    """Multiplier on the peak LR at step ``s`` (a picklable callable so the scheduler checkpoints).

    Step 0's multiplier is for the first optimizer step: warmup reaches 1.0 at ``warmup_steps``.
    """

    def __init__(self, cfg: LRSchedulerConfig, total_steps: int) -> None:
        self.warmup, self.total, self.kind = cfg.warmup_steps, total_steps, cfg.decay
        self.min_ratio, self.decay_fraction = cfg.min_lr_ratio, cfg.decay_fraction

    def __call__(self, step: int) -> float:
        s = step + 1
        if s <= self.warmup:
            return s / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":  # stable at the peak, then a linear decay over the last fraction
            decay_steps = max(1, round(self.decay_fraction * self.total))
            start = self.total - decay_steps
            if s <= start:
                return 1.0
            progress = min(1.0, (s - start) / decay_steps)
        else:
            progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # linear, wsd's decay phase
            shape = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupDecay(cfg, total_steps))
