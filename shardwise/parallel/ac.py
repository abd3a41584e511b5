"""Activation checkpointing per transformer block: ``none``, ``full``, ``selective`` (per-op policy)
or ``layer`` (every n-th block in full).

A checkpointed block saves only its input in forward and runs its forward again inside backward.
``selective`` keeps what is expensive to recompute -- matmul, attention and collective outputs --
and recomputes the cheap elementwise ops (norms, SiLU, products, RoPE), which are most of the
activation bytes but little of the FLOPs (Korthikanti et al., 2022).

The block's ``forward`` is wrapped on the instance instead of wrapping the module in another one:
parameter names stay ``layers.N.attention.wq.weight`` (weight init is seeded by name, checkpoints
are keyed by it), and the FSDP hooks that ``fully_shard`` adds later run outside the checkpointed
region, so the recompute finds the parameters FSDP has gathered for backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.config import ActivationCheckpointConfig


def _save_ops() -> set:
    """Ops whose outputs selective checkpointing keeps (those a given torch build has)."""
    aten = torch.ops.aten
    names = [
        (aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "_scaled_mm"), (aten, "_grouped_mm"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        # Collectives: recomputing them would repeat the communication (tensor/expert parallel).
        (torch.ops._c10d_functional, "reduce_scatter_tensor"),
        (torch.ops._c10d_functional, "all_gather_into_tensor"),
        (torch.ops._c10d_functional, "all_reduce"),
        (torch.ops._c10d_functional, "all_to_all_single"),
    ]
    return {getattr(ns, n).default for ns, n in names if hasattr(ns, n)}


SAVE_OPS = _save_ops()


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def checkpointed(forward: Callable[..., torch.Tensor], selective: bool) -> Callable[..., torch.Tensor]:
    """``forward`` run under non-reentrant activation checkpointing (with the op policy if
    ``selective``)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = _selective_contexts

    @functools.wraps(forward)
    def run(*args: Any, **kw: Any) -> torch.Tensor:
        return checkpoint(forward, *args, **kwargs, **kw)
    return run


def is_checkpointed(layer_id: int, cfg: ActivationCheckpointConfig) -> bool:
    """Whether ``cfg`` checkpoints the block with this (global) layer index."""
    if cfg.mode == "layer":
        return layer_id % cfg.every == 0
    return cfg.mode in ("full", "selective")


def apply_ac(model: nn.Module, cfg: ActivationCheckpointConfig) -> None:
    """Checkpoint the blocks of ``model.layers`` that ``cfg`` selects, in place (after TP, before
    compile and FSDP). Blocks are keyed by their global layer index, so ``layer`` mode picks the same
    blocks on every pipeline layout."""
    for name, block in model.layers.items():  # type: ignore[union-attr]
        if is_checkpointed(int(name), cfg):
            block.forward = checkpointed(block.forward, selective=cfg.mode == "selective")
