"""Output projection + cross-entropy computed chunk by chunk over tokens: the full ``(tokens, vocab)``
logits never exist, in forward or backward.

When the loss is summed (``sum``/``mean``) and a gradient is wanted, the loss is the last op of
the graph, so its upstream gradient is one scalar: the forward computes, for each chunk of ``C``
tokens, ``logits = h_c @ W^T``, the per-token loss and ``g = softmax - one_hot`` in one fused pass
(fp32 math on the logits, ``g`` rounded once to the compute dtype), then ``dh_c = g @ W`` and
``dW += g^T @ h_c``, and drops the logits. The backward only scales the two stored gradients by the
upstream scalar. The head costs what the plain computation costs (three ``C x V x D`` matmuls per
chunk) with one chunk's logits alive instead of ``N x V``. That elementwise pass runs through
``torch.compile`` when the run compiles (one fused kernel instead of five passes over the logits).

Per-token losses (``none``) or a forward without gradient (evaluation) take the other path: the
forward keeps each chunk's log-sum-exp and target logit only, and a backward recomputes each
chunk's logits (the head's FLOPs rise from 3x to 4x its forward).

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

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardwise.ops.autocast import autocast_dtype


def _addmm_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                round_on_cpu: bool = False) -> torch.Tensor:
    """``acc + a @ b`` in fp32, in place (``acc`` None: a fresh fp32 product): the head's weight
    gradient summed over chunks keeps fp32 partial sums (a bf16 result per chunk would round every
    chunk's contribution). On CUDA the bf16 GEMM writes its fp32 result straight into ``acc``
    (tensor cores, cuBLAS beta = 1): no second pass over the (V, D) accumulator per chunk, which at
    a 128k vocabulary and dim 2048 is 1 GB read twice and written once, a visible share of a 1B
    step on a GPU (bench/results/history.md). A CPU has no bf16 GEMM with an fp32 output: there the
    product is an fp32 GEMM of the upcast inputs, or with ``round_on_cpu`` (the fused training loss,
    whose chunks are large and few; the CPU's fp32 GEMM is ~4x slower than its bf16 one) a bf16
    GEMM whose result rounds once, as the plain computation's one product does, before the add."""
    if a.dtype == torch.float32:
        return a @ b if acc is None else acc.addmm_(a, b)
    if a.is_cuda:
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    prod = (a @ b).float() if round_on_cpu else a.float() @ b.float()
    return prod if acc is None else acc.add_(prod)


def softmax_grad(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, V) logits, (C,) labels -> per-token losses (C,) fp32 and d loss_sum / d logits =
    ``softmax - one_hot`` (C, V) in the logits' dtype, zero on ignored tokens. Eager: in place on
    one fp32 copy of the logits."""
    x = logits.float() if logits.dtype != torch.float32 else logits.clone()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, -1)
    losses = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], 0.0)
    x.sub_(lse[:, None]).exp_()  # softmax
    x[torch.arange(len(safe), device=x.device), safe] -= 1.0
    x.mul_(valid[:, None])
    return losses, x.to(logits.dtype)


def _softmax_grad_functional(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_grad` without mutation, for torch.compile: the one-hot compare fuses into the
    kernel, where the in-place form's scatter does not (125m head, bf16, chunks of 1,024: 1.15 s
    against 1.30 s compiled, 1.55 s eager); eager, the one-hot would be a (C, V) tensor."""
    x = logits.float()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, -1)
    losses = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], 0.0)
    one_hot = torch.arange(x.shape[-1], device=x.device)[None, :] == safe[:, None]
    g = ((x - lse[:, None]).exp() - one_hot.to(x.dtype)) * valid[:, None].to(x.dtype)
    return losses, g.to(logits.dtype)


@functools.cache
def compiled_softmax_grad() -> Callable:
    """:func:`softmax_grad` through torch.compile, one fused kernel (built once per process)."""
    return torch.compile(_softmax_grad_functional)


def _even_chunk(n: int, chunk: int) -> int:
    """Chunks of equal size (a compiled kernel then sees one shape): n over ceil(n/chunk) parts."""
    parts = -(-n // chunk)
    return -(-n // parts)


class _FusedLinearCE(torch.autograd.Function):
    """Summed token loss whose gradients are computed in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # noqa: ANN001
                ignore_index: int, chunk: int, kernel: Callable) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: torch.Tensor | None = None
        chunk = _even_chunk(hidden.shape[0], chunk)
        one_chunk = chunk >= hidden.shape[0]
        ctx.weight_dtype = weight.dtype
        weight = weight.to(hidden.dtype)  # (fp32 parameters under autocast: cast once for all chunks)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            losses, g = kernel(h @ weight.t(), y, ignore_index)  # (C,), (C, V): this chunk's only
            total += losses.sum()
            if need_h:
                grad_h[start:start + chunk] = g @ weight  # (C, D)
            if need_w:  # (V, D); one chunk: the product as it is, no fp32 copy
                grad_w = g.t() @ h if one_chunk else _addmm_fp32(grad_w, g.t(), h, round_on_cpu=True)
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple:  # noqa: ANN001
        grad_h, grad_w = ctx.saved_tensors
        # A bf16 tensor times an fp32 0-dim tensor multiplies in fp32 (the scale is not rounded).
        if grad_h is not None:
            grad_h = grad_h * grad_total
        if grad_w is not None:
            grad_w = (grad_w * grad_total).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # noqa: ANN001
                ignore_index: int, chunk: int) -> torch.Tensor:
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = (h @ w.t()).float()  # (C, V): the only logits alive at a time
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
        grad_w = None
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start:start + ctx.chunk], labels[start:start + ctx.chunk]
            logits = (h @ w.t()).float()  # (C, V), recomputed
            valid = y != ctx.ignore_index
            g = torch.softmax(logits, dim=-1)
            g[torch.arange(len(y), device=y.device), torch.where(valid, y, 0)] -= 1.0
            g *= (grad_losses[start:start + ctx.chunk] * valid)[:, None]  # d loss_i / d logits_i
            g = g.to(hidden.dtype)
            if need_h:
                grad_h[start:start + ctx.chunk] = g @ w
            if need_w:
                grad_w = _addmm_fp32(grad_w, g.t(), h)  # (V, D), summed over chunks in fp32, rounded once
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
        grad_w = None
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
            grad_w = _addmm_fp32(grad_w, g.t(), h)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 reduction: str = "mean", ignore_index: int = -100,
                                 chunk_size: int = 4096, compiled: bool = False) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels)`` without materializing the logits.
    ``compiled``: the fused softmax-gradient pass through torch.compile.

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
    if (dtype := autocast_dtype(hidden)) is not None:
        # Autocast would cast inside the custom autograd functions (a bf16 fp32-accumulator too), and
        # not in their backward: run them outside it, on hidden states in its dtype. An fp32 weight is
        # cast once per call inside them, and its gradient comes back in fp32.
        with torch.autocast(hidden.device.type, enabled=False):
            return chunked_linear_cross_entropy(hidden.to(dtype), weight, labels, reduction, ignore_index,
                                                chunk_size, compiled)
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
    elif reduction != "none" and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        kernel = compiled_softmax_grad() if compiled else softmax_grad
        total = _FusedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                     ignore_index, chunk_size, kernel)
        return total if reduction == "sum" else total / (labels != ignore_index).sum().clamp(min=1)
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
