"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024; used by DeepSeek-V3).

Keys and values come from one compressed latent per token: ``wkv_a`` projects the hidden state to
a ``kv_lora_rank``-wide latent (normed by ``kv_norm``) and one ``qk_rope_head_dim``-wide key that
every head shares; ``wkv_b`` expands the latent into each head's no-RoPE key part and its value.
Queries come through a low-rank pair (``wq_a``, ``q_norm``, ``wq_b``) or one full projection
(``wq``). Each query/key head is its no-RoPE part followed by its RoPE part; values have a width
of their own (``v_head_dim``).

Tensor parallel (``block.plan``): the expansions (``wq``/``wq_b``, ``wkv_b``) are column-parallel
(whole heads per rank) and ``wo`` row-parallel, as in grouped-query attention. The compressions
(``wq_a``, ``wkv_a``) and their norms are small (dim x 576 for DeepSeek-V3's keys) and stay whole on
every rank, computed on the gathered sequence; the shared RoPE key feeds only this rank's heads,
so ``shared_key`` marks where its gradient becomes a partial sum over tp.

The attention kernel takes q, k and v of one width: values narrower than q/k are zero-padded (the
padded output channels are dropped), so the fused SDPA kernels and the context-parallel ring run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config.model_args import ModelArgs
from shardwise.models.layers import AttentionCore, DocumentSpans, LayerCache, RMSNorm, apply_rope


class SharedKey(nn.Module):
    """The identity on the RoPE key every head shares (B, S, R). A module so that tensor parallel
    can mark it: each rank's heads use it, so its gradient is a partial sum over tp."""

    def forward(self, k_rope: torch.Tensor) -> torch.Tensor:
        return k_rope


class LatentAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, dim = args.n_heads, args.dim
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_dim, self.kv_lora, self.width = args.qk_head_dim, args.kv_lora_rank, args.kernel_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, h * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, h * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora, args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, dim, bias=False)
        self.shared_key = SharedKey()
        self.core = AttentionCore(scale=args.softmax_scale)

    @property
    def low_rank_q(self) -> bool:
        return hasattr(self, "wq_a")

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | DocumentSpans | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.low_rank_q else self.wq(x)
        q = q.view(b, s, -1, self.qk_dim)  # (B, S, H, nope + rope); H local under tp
        latent, k_rope = self.wkv_a(x).split([self.kv_lora, self.rope_dim], dim=-1)  # (B, S, C), (B, S, R)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim)  # (B, S, H, nope + v)
        k_rope = self.shared_key(k_rope)
        rope = rope[:s] if rope.dim() == 3 else rope
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, S, H, nope), (B, S, H, v)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope)  # (B, S, 1, R): one key for every head
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # (B, S, H, nope + R)
        # one width W for the fused kernels (zeros change nothing; a tensor already W wide is kept)
        w = self.width
        q, k, v = (F.pad(t, (0, w - t.shape[-1])) if t.shape[-1] < w else t for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, W)
        if cache is not None:  # generation: the expanded keys and values are kept
            k, v, mask = cache.update(k, v)
        out = self.core(q, k, v, mask)[..., :self.v_dim]  # (B, H, S, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, dim)
