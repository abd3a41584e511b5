"""``parallelize()``: apply each parallelism to a meta-device model in one fixed order.

The order is TP -> activation checkpointing -> compile -> FSDP (torchtitan's): TP rewrites the
linear layers into DTensor ops, checkpointing and compile wrap the already-sharded blocks, and FSDP
comes last so it shards the final parameters and its hooks sit outside everything else. TP and
FSDP/HSDP exist in this version; the other stages arrive with their issues and slot in here.
"""

from __future__ import annotations

from torch import nn

from shardwise.config import ParallelConfig
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.fsdp import apply_fsdp, mixed_precision_policy
from shardwise.parallel.tensor import apply_tp


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, mixed_precision: str) -> None:
    """Shard ``model`` (still on meta) in place according to ``dims``."""
    if dims.tp > 1:
        apply_tp(model, dims.submesh("tp"), cfg)
    mp = mixed_precision_policy(mixed_precision, cfg.fsdp_reduce_dtype)
    apply_fsdp(model, dims.fsdp_mesh(), cfg, mp)
