"""What attention does on given tokens: per layer, the largest pre-softmax logit and the most focused
head's mean entropy -- the measures of attention-logit growth, the instability QK-norm bounds
(docs/training.md, "Loss spikes")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.models.layers import apply_rope


@dataclass(frozen=True)
class AttentionStats:
    """One layer on one batch of windows."""

    max_logit: float
    """The largest q.k / sqrt(head_dim) over heads, windows and causal positions."""
    min_entropy: float
    """The lowest per-head mean attention entropy (nats), over windows and heads."""


@torch.no_grad()
def attention_stats(model: nn.Module, tokens: torch.Tensor) -> list[AttentionStats]:
    """Per layer of a one-device Llama-style ``model`` (grouped-query attention, with or without
    QK-norm), on ``tokens`` (B, S): recomputes each layer's scores from its input."""
    stats: list[AttentionStats] = []

    def hook(attn: nn.Module, inputs: tuple, _out: torch.Tensor) -> None:
        x, rope = inputs[0], inputs[1]
        b, s, _ = x.shape
        q = attn.wq(x).view(b, s, -1, attn.head_dim)  # (B, S, H, D)
        k = attn.wk(x).view(b, s, -1, attn.head_dim)  # (B, S, Hkv, D)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        rope = rope[:s] if rope.dim() == 3 else rope
        q, k = (apply_rope(t, rope).transpose(1, 2) for t in (q, k))  # (B, H, S, D)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q @ k.transpose(-1, -2)).float() / math.sqrt(attn.head_dim)  # (B, H, S, S)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean(-1)  # (B, H)
        stats.append(AttentionStats(float(logits[..., causal].max()), float(entropy.min())))

    handles = [layer.attention.register_forward_hook(hook) for layer in model.layers.values()]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    return stats
