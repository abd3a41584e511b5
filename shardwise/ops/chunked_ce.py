"""Output projection + cross-entropy computed chunk by chunk over tokens: the full ``(tokens, vocab)``
logits never exist, in forward or backward.

For each chunk of ``C`` tokens the forward computes ``logits = h_c @ W^T`` (fp32 accumulation), their
log-sum-exp and the target logit, keeps the per-token loss and drops the logits. The backward
recomputes each chunk's logits and turns them into ``softmax - one_hot`` scaled by that token's
upstream gradient, then accumulates ``dh_c = g @ W`` and ``dW += g^T @ h_c``. Peak extra memory is one
chunk's ``C x V`` logits instead of ``N x V``; the price is one more ``C x V x D`` matmul per chunk in
backward (the head's FLOPs rise from 3x to 4x its forward).

Reductions: ``sum``, ``mean`` (over the non-ignored tokens of this call) and ``none``; gradients
follow from the per-token losses, so any normalization applied afterwards -- the trainer divides a
``sum`` by the valid-token count of the whole global batch, the only normalization that stays exact
under data parallel and gradient accumulation -- is differentiated correctly by autograd.
``ignore_index`` tokens get zero loss and zero gradient.

**Vocab-parallel** (tensor parallel, loss parallel): each rank holds ``V/tp`` rows of the weight
and the whole (gathered) hidden states. Per chunk it computes its ``(C, V/tp)`` logits, and the
ranks agree on each token's log-sum-exp with one MAX and one SUM all-reduce of ``C`` values (the SUM
also carries the target logit, which only its owner holds). The backward needs no communication
for the logits: each rank forms its slice of ``softmax - one_hot`` from the saved log-sum-exp; its
``dh`` is a partial sum over its vocabulary slice, which the caller reduces (a reduce-scatter back to
sequence shards, see :func:`chunked_linear_cross_entropy`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result: low-precision inputs keep fp32 partial sums across chunks (a
    bf16 result per chunk would round every chunk's contribution)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # bf16 tensor cores, fp32 output
        except (TypeError, RuntimeError):
            pass
    return a.float() @ b.float()


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # noqa: ANN001
                ignore_index: int, chunk: int) -> torch.Tensor:
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = (h @ weight.t()).float()  # (C, V): the only logits alive at a time
            valid = y != ignore_index
            target = logits.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
            losses[start:start + chunk] = torch.where(valid, logits.logsumexp(-1) - target, 0.0)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple:  # noqa: ANN001
        hidden, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start:start + ctx.chunk], labels[start:start + ctx.chunk]
            logits = (h @ weight.t()).float()  # (C, V), recomputed
            valid = y != ctx.ignore_index
            g = torch.softmax(logits, dim=-1)
            g[torch.arange(len(y), device=y.device), torch.where(valid, y, 0)] -= 1.0
            g *= (grad_losses[start:start + ctx.chunk] * valid)[:, None]  # d loss_i / d logits_i
            g = g.to(hidden.dtype)
            if need_h:
                grad_h[start:start + ctx.chunk] = g @ weight
            if need_w:
                grad_w += _mm_fp32(g.t(), h)  # (V, D), summed over chunks in fp32, rounded once
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None


class _VocabParallelChunkedLinearCE(torch.autograd.Function):
    """The same over a vocabulary split across ``group``: ``weight`` holds rows
    ``[vocab_start, vocab_start + V_local)``; ``hidden`` and ``labels`` are the same on every rank."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # noqa: ANN001
                ignore_index: int, chunk: int, vocab_start: int, group: dist.ProcessGroup) -> torch.Tensor:
        n, v_local = hidden.shape[0], weight.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = (h @ weight.t()).float()  # (C, V/tp): this rank's vocabulary slice
            row_max = logits.max(-1).values
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)  # (C,) global max
            local = y - vocab_start
            mine = (y != ignore_index) & (local >= 0) & (local < v_local)  # target in this slice
            target = torch.where(mine, logits.gather(1, torch.where(mine, local, 0)[:, None])[:, 0], 0.0)
            stats = torch.stack([(logits - row_max[:, None]).exp().sum(-1), target])  # (2, C)
            dist.all_reduce(stats, group=group)  # sum of exp over the whole vocabulary; target logit
            lse = row_max + stats[0].log()
            lse_all[start:start + chunk] = lse
            losses[start:start + chunk] = torch.where(y != ignore_index, lse - stats[1], 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse_all)
        ctx.ignore_index, ctx.chunk, ctx.vocab_start = ignore_index, chunk, vocab_start
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple:  # noqa: ANN001
        hidden, weight, labels, lse_all = ctx.saved_tensors
        v_local = weight.shape[0]
        grad_h = torch.empty_like(hidden)  # partial over the vocabulary: the caller reduces it
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h, y = hidden[sl], labels[sl]
            g = ((h @ weight.t()).float() - lse_all[sl, None]).exp_()  # (C, V/tp) softmax slice
            local = y - ctx.vocab_start
            valid = y != ctx.ignore_index
            mine = valid & (local >= 0) & (local < v_local)
            rows = torch.arange(len(y), device=y.device)
            g[rows[mine], local[mine]] -= 1.0
            g *= (grad_losses[sl] * valid)[:, None]
            g = g.to(hidden.dtype)
            grad_h[sl] = g @ weight
            grad_w += _mm_fp32(g.t(), h)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 reduction: str = "mean", ignore_index: int = -100,
                                 chunk_size: int = 4096) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels)`` without materializing the logits.

    hidden (..., D), weight (V, D), labels (...) -> a scalar (``sum``/``mean``) or per-token losses
    (``none``, shaped like ``labels``, fp32).

    Under tensor parallel ``weight`` is a DTensor sharded on the vocabulary (``Shard(0)`` on a 1-D
    tp mesh) and ``hidden`` a DTensor (sequence-sharded under sequence parallel, or replicated):
    the hidden states are gathered over tp, the loss is computed vocab-parallel, and the gradient
    of the hidden states goes back as a partial sum (reduce-scattered to sequence shards)."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be sum, mean or none, got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = labels.shape
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        # Gathered forward; the gradient arrives as per-rank partial sums (Partial), which the
        # redistribution's backward reduce-scatters back to hidden's own placement.
        full = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        local_w = weight.to_local()
        vocab_start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())  # torch.chunk split
        losses = _VocabParallelChunkedLinearCE.apply(full.reshape(-1, full.shape[-1]), local_w,
                                                     labels.reshape(-1), ignore_index, chunk_size,
                                                     vocab_start, mesh.get_group())
    else:
        losses = _ChunkedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                        ignore_index, chunk_size)
    if reduction == "none":
        return losses.view(shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (labels != ignore_index).sum().clamp(min=1)


def reference_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
    """The plain computation on materialized fp32 logits (what the chunked op must equal)."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    out = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)
    return out.view(labels.shape) if reduction == "none" else out
