"""AdamW on torch's fused or foreach kernels, with weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config import OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW with two groups: 2-D+ parameters (matrices, embeddings) decay, 1-D ones (norms) don't.

    ``auto`` picks the fused kernel (one kernel for all parameters; CPU and CUDA both have one).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    impl = "fused" if cfg.implementation == "auto" and device_type in ("cpu", "cuda") else cfg.implementation
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "for-loop": {"foreach": False}, "auto": {}}[impl]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)
