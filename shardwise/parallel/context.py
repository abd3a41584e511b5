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

CPU: torch 2.13 ships ring handlers for the CUDA SDPA ops only (flash, efficient, cuDNN). CPU SDPA
runs ``_scaled_dot_product_flash_attention_for_cpu``; :func:`enable_ring_attention` registers ring
handlers for that op and its backward in torch's own context-parallel op table, built on torch's
templated ring attention, so the CPU path is the same machinery as the CUDA one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
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

aten = torch.ops.aten
SEQ_DIM = 2  # q/k/v inside attention are (B, H, S, D)


def apply_cp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, seq_len: int) -> None:
    """Make every block's attention core a ring attention over the 1-D ``cp`` mesh, and record
    which sequence positions this rank holds (``model.rope_positions``, used by ``init_weights``
    for the RoPE table)."""
    enable_ring_attention(cfg.cp_rotate_method)
    for block in blocks(model):
        parallelize_module(block.get_submodule(block.plan.attention_core), mesh,
                           _ContextParallel(seq_dim=SEQ_DIM,
                                            attention_type=_ContextParallel.AttentionType.SDPA))
    model.rope_positions = local_positions(seq_len, mesh, cfg.cp_load_balance)


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
