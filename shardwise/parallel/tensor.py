"""Tensor + sequence parallel for the Llama family, with loss parallel, on DTensor.

Megatron-style TP (Shoeybi et al., 2019) with sequence parallel (Korthikanti et al., 2022): the
residual stream between blocks stays sharded along the sequence (``Shard(1)``), so norms run on
``S/tp`` tokens each. Entering attention or the MLP, the activations are all-gathered (over tp);
Q/K/V and w1/w3 are column-parallel (each rank owns whole heads / a slice of the hidden dim); wo and
w2 are row-parallel and reduce-scatter their output back to sequence shards.

With ``parallel.loss_parallel`` the output head stays column-parallel (vocab-sharded logits,
``Shard(-1)``) and the cross-entropy runs under ``loss_parallel()``: no rank ever holds the full
logits. The trainer enters that context whenever the logits arrive as a DTensor.

Groups converted to float8 (shardwise/parallel/float8.py) take torchao's float8 styles: the input is
cast to float8 on its sequence shard, with the amax reduced over tp, and all-gathered in float8.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.config.schema import ParallelConfig
from shardwise.models.moe import MoE
from shardwise.parallel.float8 import tp_styles


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s global value (a loss-parallel loss is a replicated DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def apply_tp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    """Shard ``model`` over the 1-D ``tp`` mesh in place (call before FSDP)."""
    if cfg.async_tp:
        enable_async_tp(mesh)
    float8_comm = dist.get_backend(mesh.get_group()) != "gloo"  # gloo has no float8 dtypes
    parallelize_module(model, mesh, {
        # Vocab-sharded lookup; the partial sums are reduce-scattered into sequence shards.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if cfg.loss_parallel else Replicate(),
                                  use_local_output=not cfg.loss_parallel),
    })
    for block in model.layers.values():  # type: ignore[union-attr]
        if isinstance(block.feed_forward, MoE):
            ffn_plan = {
                # MoE blocks stay on the sequence shard: each tp rank routes its own S/tp tokens
                # (no gather), and router and experts are not split over tp -- FSDP shards them over
                # dp_shard x cp x tp instead and sums their gradients over all of those ranks. The
                # output is the local shard, as the residual stream between blocks is.
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Shard(1),),
                                                   use_local_output=True),
            }
        else:
            col, row, prepare = tp_styles(block.feed_forward, "w1", float8_comm)
            ffn_plan = {
                "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": col(),
                "feed_forward.w2": row(output_layouts=Shard(1)),  # reduce-scatter over tp
                "feed_forward.w3": col(),
            }
        col, row, prepare = tp_styles(block.attention, "wq", float8_comm)
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # (x, rope, mask): gather x over the sequence (all-gather over tp); RoPE table and
            # document mask are plain tensors, the same on every rank.
            "attention": prepare(input_layouts=(Shard(1), None, None),
                                 desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": col(),
            "attention.wk": col(),
            "attention.wv": col(),
            "attention.wo": row(output_layouts=Shard(1)),  # reduce-scatter over tp
            "ffn_norm": SequenceParallel(),
            **ffn_plan,
            # QK-norm runs on this rank's heads (dim 2 of (B, S, H/tp, D)): its weight is replicated
            # and its gradient, a partial sum over the local heads, is summed over tp.
            **({"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
               if block.attention.q_norm is not None else {}),
        })


def enable_async_tp(mesh: DeviceMesh) -> None:
    """torch's micro-pipelined TP: inductor rewrites each all-gather -> matmul and matmul ->
    reduce-scatter of the compiled blocks into chunked collectives over symmetric memory that
    overlap the matmul's chunks (torch._inductor.config._micro_pipeline_tp). Older torch needs the
    TP group registered for symmetric memory; 2.13 does it by itself and deprecates the call.
    Checked before (resolve.check_async_tp): CUDA, NCCL, compile. Written, not yet run on a GPU."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    inductor_config._micro_pipeline_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (deprecated where not needed)
            enable(mesh.get_group().group_name)
