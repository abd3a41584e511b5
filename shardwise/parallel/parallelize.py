"""``parallelize()``: apply each parallelism to a meta-device model in one fixed order.

The order is float8 conversion -> TP -> CP -> EP -> activation checkpointing -> compile -> FSDP
(torchtitan's): float8 swaps the linear modules first so TP picks float8 styles for them, TP
rewrites the linear layers into DTensor ops, CP wraps the attention cores (no parameters), EP shards
the MoE experts over their own mesh dim and wraps them in the token exchange, checkpointing and
compile wrap the already-sharded blocks, and FSDP comes last so it shards the final parameters and
its hooks sit outside everything else. Pipeline parallel happens before all of them (the model is
cut into this rank's stage first); the other stages arrive with their issues and slot in here.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config.schema import Config
from shardwise.models.protocol import has_experts
from shardwise.parallel.ac import apply_ac
from shardwise.parallel.compile import apply_compile
from shardwise.parallel.context import apply_cp
from shardwise.parallel.dims import Mesh, ParallelDims
from shardwise.parallel.expert import apply_ep
from shardwise.parallel.float8 import apply_float8
from shardwise.parallel.fsdp import apply_autocast, apply_fsdp, mixed_precision_policy, plain_rank
from shardwise.parallel.tensor import apply_tp, emulate_tp_rounding


def parallelize(model: nn.Module, dims: ParallelDims, config: Config, compiled: bool = False) -> None:
    """Shard ``model`` (still on meta) in place according to ``dims`` and the parallel, float8 and
    activation-checkpoint sections of ``config``; ``compiled`` (the resolved compile.enabled,
    ``ResolvedRun.compile``) compiles its blocks."""
    cfg = config.parallel
    apply_float8(model, config.float8, dims.tp, dims.mesh.device_type)
    if dims.tp > 1:
        apply_tp(model, dims.submesh(Mesh.TP), cfg)
    elif config.debug.tp_rounding > 1:  # (one rank, checked: resolve.check_tp_rounding)
        emulate_tp_rounding(model, config.debug.tp_rounding)
    if dims.cp > 1:
        # The training sequence length fixes which positions each cp rank holds.
        apply_cp(model, dims.submesh(Mesh.CP), cfg, config.training.seq_len, config.data.document_mask)
    moe_meshes = {}
    if has_experts(model):
        moe_meshes = dims.moe_meshes()
        if dims.ep > 1:
            apply_ep(model, moe_meshes[Mesh.EP])
    apply_ac(model, config.activation_checkpoint)
    apply_compile(model, compiled)
    device = dims.target_device or dims.mesh.device_type
    if plain_rank(dims.world_size, device, cfg.one_rank):
        if config.training.mixed_precision == "bf16":
            apply_autocast(model, device, torch.bfloat16)
        return
    mp = mixed_precision_policy(config.training.mixed_precision, cfg.fsdp_reduce_dtype)
    apply_fsdp(model, dims.fsdp_mesh(), cfg, mp, moe_meshes, dims.target_device)
