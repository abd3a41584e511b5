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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 reduction: str = "mean", ignore_index: int = -100,
                                 chunk_size: int = 4096) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels)`` without materializing the logits.

    hidden (..., D), weight (V, D), labels (...) -> a scalar (``sum``/``mean``) or per-token losses
    (``none``, shaped like ``labels``, fp32)."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be sum, mean or none, got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = labels.shape
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
