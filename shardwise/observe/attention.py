"""What attention does on given tokens: per layer, the largest pre-softmax logit and the most focused
head's mean entropy -- the measures of attention-logit growth, the instability QK-norm bounds
(docs/training.md, "Loss spikes")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionStats:
    """One layer on one batch of windows."""

    max_logit: float
    """The largest q.k / sqrt(head_dim) over heads, windows and causal positions."""
    min_entropy: float
    """The lowest per-head mean attention entropy (nats), over windows and heads."""


@torch.no_grad()
def attention_stats(model: nn.Module, tokens: torch.Tensor) -> list[AttentionStats]:
    """Per layer of a one-device ``model`` (grouped-query or latent attention, with or without
    QK-norm), on ``tokens`` (B, S): the scores of the queries and keys each layer's attention core
    is given (after QK-norm and RoPE), at the core's own scale."""
    stats: list[AttentionStats] = []

    def hook(core: nn.Module, inputs: tuple) -> None:
        q, k = inputs[0], inputs[1]  # (B, H, S, W), (B, Hkv, S, W)
        s = q.shape[2]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = core.scale if core.scale is not None else 1 / math.sqrt(q.shape[-1])
        logits = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, S, S)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean(-1)  # (B, H)
        stats.append(AttentionStats(float(logits[..., causal].max()), float(entropy.min())))

    handles = [layer.attention.core.register_forward_pre_hook(hook) for layer in model.layers.values()]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    return stats
