"""Context parallel: the sequence sharded over ``cp`` with ring attention (Liu et al., 2023).

Each cp rank holds ``S/cp`` positions of every sequence -- tokens, labels and the RoPE rows of those
positions. Attention is the only op that mixes positions: the attention core of every block is
wrapped by torch's ``_ContextParallel`` style, which turns the local q/k/v into DTensors sharded on
the sequence dim of the ``cp`` mesh, and torch's context-parallel dispatcher runs the SDPA op as a
ring: each rank keeps its queries, the key/value shards travel around the ring, and the partial
outputs are merged by their log-sum-exp. Everything else (norms, MLP, loss) is per position and
needs no communication; FSDP shards parameters over ``dp_shard x cp`` and sums their gradients.

Load balancing (``parallel.cp_load_balance``, on by default): under a causal mask the last shard
attends to the whole sequence and the first to almost nothing, so the sequence is cut into
``2*cp`` chunks and rank ``r`` takes chunks ``r`` and ``2*cp-1-r`` (head-tail); every rank then does
the same work.

Document masks (packed chat data): the cores are not wrapped. Each rank gathers the keys and values
of the whole sequence (torch's differentiable all-gather, whose backward reduce-scatters their
gradients: the traffic of the ``allgather`` rotation) and attends its own queries -- both head-tail
chunks -- within their documents: for each (chunk, document) piece, the piece's causal square and,
when the document began earlier, its earlier keys (on CPU as an aligned block and a remainder,
:func:`_blocks`), merged by their log-sum-exp; elsewhere one SDPA call per piece with a lower-right
causal bias (:class:`RingDocuments`). The model gets the whole window's document ids; only its
tokens are sharded.

CPU: torch 2.13 ships ring handlers for the CUDA SDPA ops only (flash, efficient, cuDNN). CPU SDPA
runs ``_scaled_dot_product_flash_attention_for_cpu``; :func:`enable_ring_attention` registers ring
handlers for that op and its backward in torch's own context-parallel op table, built on torch's
templated ring attention, so the CPU path is the same machinery as the CUDA one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
from torch.distributed.tensor.experimental._context_parallel import (
    _context_parallel_shard,
    _ContextParallel,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    set_rotate_method,
)
from torch.distributed.tensor.parallel import parallelize_module

from shardwise.config.schema import ParallelConfig
from shardwise.models.protocol import blocks
from shardwise.ops.flash_cpu import RUN_ALIGN, aligned, padded

aten = torch.ops.aten
SEQ_DIM = 2  # q/k/v inside attention are (B, H, S, D)


def apply_cp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, seq_len: int,
             document_mask: bool = False) -> None:
    """Make every block's attention core a ring attention over the 1-D ``cp`` mesh, and record
    which sequence positions this rank holds (``model.rope_positions``, used by ``init_weights``
    for the RoPE table). With ``document_mask`` the cores stay as they are and the model's document
    spans become :class:`RingDocuments` (the module's docstring)."""
    model.rope_positions = local_positions(seq_len, mesh, cfg.cp_load_balance)
    if document_mask:
        every = _all_positions(model.rope_positions, mesh)
        model.document_spans = functools.partial(RingDocuments.of, positions=model.rope_positions,
                                                 all_positions=every, group=mesh.get_group())
        return
    enable_ring_attention(cfg.cp_rotate_method)
    for block in blocks(model):
        parallelize_module(block.get_submodule(block.plan.attention_core), mesh,
                           _ContextParallel(seq_dim=SEQ_DIM,
                                            attention_type=_ContextParallel.AttentionType.SDPA))


def local_positions(seq_len: int, mesh: DeviceMesh, load_balance: bool) -> torch.Tensor:
    """The positions (S/cp,) of a length-``seq_len`` sequence that this cp rank holds, in order."""
    positions = torch.arange(seq_len, device=mesh.device_type)
    return shard_sequences(mesh, [positions], load_balance, seq_dims=[0])[0]


def shard_sequences(mesh: DeviceMesh, tensors: Sequence[torch.Tensor], load_balance: bool,
                    seq_dims: Sequence[int] | None = None) -> list[torch.Tensor]:
    """This cp rank's part of each tensor along its sequence dim (default 1: (B, S, ...))."""
    seq_dims = list(seq_dims) if seq_dims is not None else [1] * len(tensors)
    seq_len = tensors[0].shape[seq_dims[0]]
    balancer = _HeadTailLoadBalancer(seq_len, mesh.size(), tensors[0].device) if load_balance else None
    # Also sets torch's global "load balance on/off" flag that the ring attention reads.
    return _context_parallel_shard(mesh, list(tensors), seq_dims, load_balancer=balancer)


# ---------------------------------------------------------------------------------------------
# Document masks under context parallel


def _all_positions(positions: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every cp rank's positions, in rank order (what an all-gather of the sequence dim lays out)."""
    out = torch.empty(positions.numel() * mesh.size(), dtype=positions.dtype, device=positions.device)
    torch.distributed.all_gather_into_tensor(out, positions.contiguous(), group=mesh.get_group())
    return out


@dataclass(frozen=True)
class RingDocuments:
    """Document-masked attention of this cp rank's queries over the whole sequence's keys.

    ``pieces``: for each (sequence, local chunk, document) a ``(b, q0, n, k0, p)``: the queries at local
    rows ``q0 .. q0+n`` are global positions ``p .. p+n`` of a document that starts at ``k0``; they see
    the keys ``k0 .. p`` in full and ``p .. p+n`` causally."""

    pieces: tuple[tuple[int, int, int, int, int], ...]
    order: torch.Tensor  # (S,) the gathered row of each global position
    group: dist.ProcessGroup

    @staticmethod
    def of(doc_ids: torch.Tensor, positions: torch.Tensor, all_positions: torch.Tensor,
           group: dist.ProcessGroup) -> RingDocuments:
        """From the whole window's document ids (B, S) and this rank's positions (S/cp,): one host
        sync per forward."""
        ids, pos = doc_ids.cpu().numpy(), positions.cpu().numpy()
        b, s = ids.shape
        cuts = np.flatnonzero(np.diff(pos) != 1) + 1
        chunks = list(zip([0, *cuts.tolist()], [*cuts.tolist(), len(pos)], strict=True))  # local runs
        pieces = []
        for row in range(b):
            new = np.ones(s, dtype=bool)
            new[1:] = ids[row, 1:] != ids[row, :-1]
            first = np.maximum.accumulate(np.where(new, np.arange(s), 0))  # (S,) its document's start
            ends = np.append(np.flatnonzero(new)[1:], s)
            last = ends[np.searchsorted(np.flatnonzero(new), np.arange(s), side="right") - 1]  # (S,) end
            for lo, hi in chunks:
                p, stop = int(pos[lo]), int(pos[hi - 1]) + 1
                while p < stop:
                    end = min(stop, int(last[p]))
                    pieces.append((row, lo + p - int(pos[lo]), end - p, int(first[p]), p))
                    p = end
        return RingDocuments(tuple(pieces), torch.argsort(all_positions), group)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """q (B, H, S/cp, D), k/v (B, Hkv, S/cp, D) of this rank -> (B, H, S/cp, Dv)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        order = self.order.to(k.device)
        # all-gather over cp (backward: reduce-scatter), then into position order: (B, Hkv, S, D)
        k, v = (all_gather_tensor_autograd(t.contiguous(), gather_dim=SEQ_DIM, group=self.group)
                .index_select(SEQ_DIM, order) for t in (k, v))
        if q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
            return _PiecesCPU.apply(q, k, v, self.pieces, scale)
        return _pieces_sdpa(q, k, v, self.pieces, scale)


def _pieces_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple, scale: float | None
                 ) -> torch.Tensor:
    """The pieces through SDPA with a lower-right causal bias (each piece's queries are the last
    rows of its keys): the flash and efficient kernels take it on GPUs."""
    from torch.nn.attention.bias import causal_lower_right

    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for b, q0, n, k0, p in pieces:
        out[b:b + 1, :, q0:q0 + n] = F.scaled_dot_product_attention(
            q[b:b + 1, :, q0:q0 + n], k[b:b + 1, :, k0:p + n], v[b:b + 1, :, k0:p + n],
            attn_mask=causal_lower_right(n, p + n - k0), enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    return out


def _blocks(k0: int, p: int, n: int) -> list[tuple[int, int, bool]]:
    """A piece's key blocks (lo, hi, causal): its causal square, then the document's earlier keys as
    a block of a multiple of RUN_ALIGN keys and one of fewer (the CPU flash kernels meet a handful of
    key lengths: ops/flash_cpu.py says why)."""
    cut = k0 + (p - k0) % RUN_ALIGN
    return [(p, p + n, True)] + [(lo, hi, False) for lo, hi in ((k0, cut), (cut, p)) if hi > lo]


class _PiecesCPU(torch.autograd.Function):
    """The pieces on torch's CPU flash kernels: forward merges a piece's blocks (:func:`_blocks`) by
    their log-sum-exp; backward runs each block's flash backward against the merged output and
    log-sum-exp (as ring attention's backward does), summing into the gradients. Query rows (and the
    causal square's keys) are padded to a multiple of RUN_ALIGN; pad rows carry no gradient and a
    log-sum-exp of +inf, so they add nothing."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple,
                scale: float | None) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # (B, H, S/cp, Dv)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # (B, H, S/cp)
        for b, q0, n, k0, p in pieces:
            m = aligned(n)
            qb = padded(q[b:b + 1, :, q0:q0 + n], m)
            merged, total = None, None
            for lo, hi, causal in _blocks(k0, p, n):
                kb, vb = k[b:b + 1, :, lo:hi], v[b:b + 1, :, lo:hi]
                if causal:
                    kb, vb = padded(kb, m), padded(vb, m)
                o, sums = flash(qb, kb, vb, 0.0, causal, scale=scale)
                o, sums = o[:, :, :n].float(), sums[:, :, :n]
                if merged is None:
                    merged, total = o, sums
                else:
                    both = torch.logaddexp(total, sums)
                    merged = merged * (total - both).exp()[..., None] + o * (sums - both).exp()[..., None]
                    total = both
            out[b:b + 1, :, q0:q0 + n], lse[b:b + 1, :, q0:q0 + n] = merged, total
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale = pieces, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.to(out.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        for b, q0, n, k0, p in ctx.pieces:
            m = aligned(n)
            rows = (slice(b, b + 1), slice(None), slice(q0, q0 + n))
            qb, gb, ob = (padded(t[rows], m) for t in (q, grad, out))
            sums = padded(lse[rows], m, float("inf"))  # pad rows: P = exp(s - inf) = 0
            for lo, hi, causal in _blocks(k0, p, n):
                keys = (slice(b, b + 1), slice(None), slice(lo, hi))
                kb, vb = k[keys], v[keys]
                if causal:
                    kb, vb = padded(kb, m), padded(vb, m)
                dqb, dkb, dvb = backward(gb, qb, kb, vb, ob, sums, 0.0, causal, scale=ctx.scale)
                dq[rows] += dqb[:, :, :n]
                dk[keys] += dkb[:, :, :hi - lo]
                dv[keys] += dvb[:, :, :hi - lo]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# ---------------------------------------------------------------------------------------------
# Ring handlers for CPU SDPA (torch 2.13 has them for the CUDA ops only)


def _ring_flash_cpu(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
    scale) -> (out, logsumexp)`` on sequence-sharded DTensors, as a ring."""
    q, k, v = args[:3]
    dropout_p, is_causal = _dropout_causal(args[3:], kwargs)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context-parallel ring attention takes no attn_mask (causal only)")
    mesh = _cp_mesh(q)
    out, lse = cp_attention._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu.default,
        q.to_local(), k.to_local(), v.to_local(), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return _seq_sharded(out, mesh), _seq_sharded(lse, mesh)


def _ring_flash_cpu_backward(op_call: torch._ops.OpOverload, args: tuple,
                             kwargs: dict) -> tuple[DTensor, DTensor, DTensor]:
    """``_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp,
    dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)`` as a ring."""
    grad_out, q, k, v, out, lse = args[:6]
    dropout_p, is_causal = _dropout_causal(args[6:], kwargs)
    mesh = _cp_mesh(q)
    dq, dk, dv = cp_attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out.to_local(), grad_out_name="grad_out", query=q.to_local(),
        key=k.to_local(), value=v.to_local(), out=out.to_local(), logsumexp=lse.to_local(),
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _seq_sharded(dq, mesh), _seq_sharded(dk, mesh), _seq_sharded(dv, mesh)


def _dropout_causal(rest: tuple, kwargs: dict) -> tuple[float, bool]:
    dropout_p = rest[0] if len(rest) > 0 else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    return dropout_p, is_causal


def _cp_mesh(t: torch.Tensor) -> DeviceMesh:
    if not isinstance(t, DTensor) or t.placements != (Shard(SEQ_DIM),):
        raise RuntimeError("context-parallel attention expects q/k/v sharded on the sequence dim of "
                           "the 1-D cp mesh")
    return t.device_mesh


def _seq_sharded(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    # Called inside DTensor's dispatch (below autograd): wrap without communication.
    return DTensor.from_local(local, mesh, [Shard(SEQ_DIM)], run_check=False)


CPU_HANDLERS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _ring_flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _ring_flash_cpu_backward,
}


def enable_ring_attention(rotate_method: str = "allgather") -> None:
    """Turn on torch's context-parallel SDPA dispatch (CUDA ops) with our CPU handlers added.

    Process-wide, but it only changes SDPA ops on DTensors, which only the cp-wrapped attention
    cores produce."""
    cp_attention.custom_ops.update(CPU_HANDLERS)
    set_rotate_method(rotate_method)
    _enable_context_parallel_dispatcher()
