"""Layers the blocks share: norms, the SwiGLU MLP, RoPE, the attention kernel and generation's key-value
cache (llama.py, mla.py, moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` (B, S, H, D) by ``rope`` (S, D/2, 2) or (B, S, D/2, 2),
    a :func:`rope_table` slice.

    Pairs are interleaved (channels 2i, 2i+1), Meta's Llama convention; the rotation runs in fp32.
    Eager, one complex multiply is the fewest kernels; compiled, the same product in real arithmetic,
    which inductor fuses with the casts around it (it generates no code for complex ops and would
    run that multiply as an eager kernel in the middle of the graph). Both round the same products
    of fp32 numbers (test_model checks them against each other).
    """
    r = (rope.unsqueeze(-3) if rope.dim() == 4 else rope[None, :, None]).float()  # (B|1, S, 1, D/2, 2)
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, S, H, D/2, 2)
    if torch.compiler.is_compiling():
        (x0, x1), (cos, sin) = pairs.unbind(-1), r.unbind(-1)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(r))
    return out.flatten(-2).type_as(x)


class AttentionCore(nn.Module):
    """softmax(q k^T * scale) v with a causal (or document) mask: (B, H, S, D) in and out; ``scale``
    None is 1/sqrt(D).

    A module of its own so that context parallel can wrap exactly this part (as a ring attention).
    """

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # Plain causal attention takes SDPA's is_causal fast path; a document mask is explicit.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)


class KVCache:
    """Keys and values of every block for generation: each forward given the cache appends its
    tokens' keys and values (at the positions after those held) and attends to all of them. Room
    for ``max_len`` tokens is allocated per block at its first use."""

    def __init__(self, max_len: int) -> None:
        self.max_len, self.length = max_len, 0
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer_id: int) -> LayerCache:
        return LayerCache(self, layer_id)

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k, v (B, Hkv, S, D) of the new tokens -> every held token's (B, Hkv, T, D), and the mask
        of the new queries over them (None: plain causal, when nothing was held before)."""
        b, h, s, d = k.shape
        end = self.length + s
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; {end} asked")
        if layer_id not in self._kv:
            self._kv[layer_id] = (k.new_zeros(b, h, self.max_len, d), v.new_zeros(b, h, self.max_len, d))
        keys, values = self._kv[layer_id]
        keys[:, :, self.length:end], values[:, :, self.length:end] = k, v
        mask = None if self.length == 0 else torch.ones(s, end, dtype=torch.bool, device=k.device).tril(
            self.length)  # (S, T): new query i sees the held tokens and new ones up to itself
        return keys[:, :, :end], values[:, :, :end], mask


@dataclass(frozen=True)
class LayerCache:
    """One block's view of a :class:`KVCache`."""

    cache: KVCache
    layer_id: int

    def update(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.cache.append(self.layer_id, k, v)
