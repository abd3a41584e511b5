"""Layers the blocks share: norms, the SwiGLU MLP, RoPE, the attention kernel and generation's key-value
cache (transformer.py, mla.py, moe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.ops.cpu_bf16 import fp32_gemms_for_bf16
from shardwise.ops.flash_cpu import aligned


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


@dataclass(frozen=True)
class DocumentSpans:
    """Where the documents of a packed micro-batch lie: the length of each run of equal document id,
    sequence after sequence (the lengths sum to B * S; a run never crosses two sequences).

    Document-masked attention is causal attention within each run. Held as run lengths, not as a
    (B, 1, S, S) mask: the memory is one integer per document, and each document's attention is an
    ordinary causal SDPA call (flash kernels, O(S) memory), whose pairs sum to ``sum L^2 / 2``
    instead of ``S^2 / 2``."""

    lengths: tuple[int, ...]
    batch: int
    seq_len: int

    @staticmethod
    def of(doc_ids: torch.Tensor) -> DocumentSpans:
        """From document ids (B, S): one host sync (the run lengths travel to the host once per
        forward, not per block)."""
        b, s = doc_ids.shape
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]  # every sequence starts a run
        first = starts.flatten().nonzero().flatten()  # (runs,)
        ends = torch.cat([first[1:], first.new_tensor([b * s])])
        return DocumentSpans(tuple((ends - first).tolist()), b, s)


class AttentionCore(nn.Module):
    """softmax(q k^T * scale) v, causal, within documents when given :class:`DocumentSpans`, or under an
    explicit boolean mask (generation's key-value cache): (B, H, S, D) in and out; ``scale`` None is
    1/sqrt(D).

    A module of its own so that context parallel can wrap exactly this part (as a ring attention).
    """

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | DocumentSpans | Any | None = None) -> torch.Tensor:
        if q.dtype == torch.bfloat16 and fp32_gemms_for_bf16() and not torch.compiler.is_compiling():
            # A CPU without bf16 arithmetic (shardwise.ops.cpu_bf16): torch's bf16 flash kernels run
            # 5-6x slower there than fp32's, so attention runs in fp32 on the bf16 values, its output
            # rounded once -- as a GPU's bf16 flash kernel scores and normalizes in fp32.
            return self.forward(q.float(), k.float(), v.float(), mask).to(q.dtype)
        if isinstance(mask, DocumentSpans):
            return attention_by_document(q, k, v, mask, self.scale)
        if hasattr(mask, "attention"):  # document masks another part gives (context parallel's)
            return mask.attention(q, k, v, self.scale)
        # Plain causal attention takes SDPA's is_causal fast path.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)


@torch.compiler.disable  # the loop's length changes with every batch: compiled, each would recompile
def attention_by_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans,
                          scale: float | None = None) -> torch.Tensor:
    """Causal attention inside each document of ``spans``: q (B, H, S, D), k/v (B, Hkv, S, D) ->
    (B, H, S, Dv). Equal to SDPA under the dense document mask, with one causal flash-attention call
    per document.

    Sequences and documents are laid end to end as (B*S, H, D) rows and split into runs. On CPU one
    autograd function runs torch's flash kernel per run and writes every run's output into one
    tensor, which is also what the next projection saves: the same activation memory as a causal
    step. Elsewhere (or with value heads narrower than the query's) each run is an ordinary SDPA call,
    whose outputs are kept once more, joined."""
    b, h, s, _ = q.shape
    if (b, s) != (spans.batch, spans.seq_len):
        raise ValueError(f"document spans of {spans.batch} x {spans.seq_len} tokens given for q of "
                         f"{b} x {s}")
    if q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:  # (the CPU flash kernel's condition)
        return _FlashByDocumentCPU.apply(q, k, v, spans.lengths, scale)
    gqa = q.shape[1] != k.shape[1]
    runs = zip(*(_runs(t, spans.lengths) for t in (q, k, v)), strict=True)
    outs = [F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=gqa, scale=scale)[0]
            .transpose(0, 1) for qi, ki, vi in runs]
    return torch.cat(outs).view(b, s, h, -1).transpose(1, 2)  # (B, H, S, Dv)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, H, S, ...) -> (B*S, H, ...): a view when ``t`` was made from (B, S, H, ...) by a transpose."""
    return t.transpose(1, 2).flatten(0, 1)


def _runs(t: torch.Tensor, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Each run of (B, H, S, D) ``t`` as a (1, H, L, D) view, for SDPA (split's backward is one copy,
    where slicing per run would zero-fill a full-size gradient for every run)."""
    return _split(_rows(t), lengths)


def _aligned_rows(lengths: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], torch.Tensor | None, torch.Tensor | None]:
    """Each run's aligned length; for each aligned row the real row it copies (a pad row repeats its
    run's last); and which aligned rows are pads. Both None when every run is aligned already."""
    runs = tuple(aligned(n) for n in lengths)
    if runs == lengths:
        return lengths, None, None
    n, p = torch.tensor(lengths), torch.tensor(runs)
    real_start, pad_start = n.cumsum(0) - n, p.cumsum(0) - p  # (runs,)
    within = torch.arange(int(p.sum())) - pad_start.repeat_interleave(p)  # row within its aligned run
    last = (n - 1).repeat_interleave(p)
    return runs, real_start.repeat_interleave(p) + torch.minimum(within, last), within > last


def _aligned_copy(t: torch.Tensor, index: torch.Tensor | None, pads: torch.Tensor | None = None,
                  fill: float | None = None) -> torch.Tensor:
    """Rows (B*S, H, ...) of (B, H, S, ...) ``t``, runs aligned by ``index`` (one gather; a view without),
    pad rows set to ``fill`` when given."""
    rows = _rows(t)
    if index is None:
        return rows
    rows = rows.index_select(0, index.to(t.device))
    if fill is not None:
        rows[pads.to(t.device)] = fill
    return rows


class _FlashByDocumentCPU(torch.autograd.Function):
    """Per-document causal attention on torch's CPU flash kernels (forward and backward), each run
    aligned for the call (ops/flash_cpu.py) in one gathered copy per tensor that lives for the
    call only. It saves q, k, v, the output and the log-sum-exp: what one causal SDPA call saves."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...],
                scale: float | None) -> torch.Tensor:
        b, h, s, _ = q.shape
        runs, index, _ = _aligned_rows(lengths)
        out = q.new_empty(b * s, h, v.shape[-1])  # (B*S, H, Dv)
        lse = q.new_empty(b * s, h, dtype=torch.float32)  # (B*S, H)
        start = 0
        for qi, ki, vi, n in zip(*(_split(_aligned_copy(t, index), runs) for t in (q, k, v)), lengths,
                                 strict=True):
            o, sums = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qi, ki, vi, 0.0, True,
                                                                                  scale=scale)
            out[start:start + n] = o[0, :, :n].transpose(0, 1)
            lse[start:start + n] = sums[0, :, :n].transpose(0, 1)
            start += n
        result = out.view(b, s, h, -1).transpose(1, 2)  # (B, H, S, Dv)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.lengths, ctx.scale = lengths, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        lengths = ctx.lengths
        runs, index, pads = _aligned_rows(lengths)
        b, h, s, _ = q.shape
        # Pad rows: no gradient and a log-sum-exp of +inf (P = 0), so they add nothing; their output
        # is a real row's (finite; rowsum(dO * O) is 0 there).
        parts = (*(_split(_aligned_copy(t, index), runs) for t in (q, k, v, out)),
                 _split(_aligned_copy(grad.to(out.dtype), index, pads, 0.0), runs),
                 _split(_aligned_copy(lse.view(b, s, h).transpose(1, 2), index, pads, float("inf")), runs))
        grads = [torch.empty_like(_rows(t)) for t in (q, k, v)]  # (B*S, H, D) each
        start = 0
        for qi, ki, vi, oi, gi, sums, n in zip(*parts, lengths, strict=True):
            d = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gi, qi, ki, vi, oi, sums, 0.0, True, scale=ctx.scale)
            for full, part in zip(grads, d, strict=True):
                full[start:start + n] = part[0, :, :n].transpose(0, 1)
            start += n
        dq, dk, dv = (g.view(b, s, g.shape[1], -1).transpose(1, 2) for g in grads)
        return dq, dk, dv, None, None


def _split(rows: torch.Tensor, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """(rows, H, D) -> each run as (1, H, L, D) (a view)."""
    return [r.transpose(0, 1)[None] for r in rows.split(lengths)]


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
