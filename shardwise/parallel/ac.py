"""Activation checkpointing per transformer block: ``none``, ``full``, ``selective`` (per-op policy),
``selective_half`` or ``layer`` (every n-th block in full).

A checkpointed block saves only its input in forward and runs its forward again inside backward.
``selective`` keeps what is expensive to recompute -- matmul, attention and collective outputs --
and recomputes the cheap elementwise ops (norms, SiLU, products, RoPE), which are most of the
activation bytes but little of the FLOPs (Korthikanti et al., 2022). ``selective_half`` also
recomputes every second linear-layer matmul of the block (wk, wo, w3 of a dense block: their
outputs are large and they are a third of its linear FLOPs), the trade torchtitan's per-op policy
makes; attention, grouped expert GEMMs and collectives stay kept.

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

from shardwise.config.schema import ActivationCheckpointConfig


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


def _linear_ops() -> set:
    """The 2-D matmuls of linear layers, which ``selective_half`` counts (the grouped experts run
    ``_grouped_mm`` or, unaligned, ``bmm``; attention its own ops: neither is counted)."""
    aten = torch.ops.aten
    return {getattr(aten, n).default for n in ("mm", "addmm", "_scaled_mm") if hasattr(aten, n)}


LINEAR_OPS = _linear_ops()


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def _half_contexts() -> Any:
    """A fresh policy per checkpointed call: the n-th linear matmul is kept when n is odd, counted
    separately in forward and in the recompute so both agree on which ones they are."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in LINEAR_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _policy(ctx, op, *args, **kwargs)
    return create_selective_checkpoint_contexts(policy)


def checkpointed(forward: Callable[..., torch.Tensor], policy: str = "full") -> Callable[..., torch.Tensor]:
    """``forward`` run under non-reentrant activation checkpointing: ``full`` (its input kept),
    ``selective`` or ``selective_half`` (the per-op policies above)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy != "full":
        kwargs["context_fn"] = {"selective": _selective_contexts, "selective_half": _half_contexts}[policy]

    @functools.wraps(forward)
    def run(*args: Any, **kw: Any) -> torch.Tensor:
        return checkpoint(forward, *args, **kwargs, **kw)
    return run


def is_checkpointed(layer_id: int, cfg: ActivationCheckpointConfig) -> bool:
    """Whether ``cfg`` checkpoints the block with this (global) layer index."""
    if cfg.mode == "layer":
        return layer_id % cfg.every == 0
    return cfg.mode != "none"


def recomputes_whole(layer_id: int, cfg: ActivationCheckpointConfig) -> bool:
    """Whether ``cfg`` runs this block's forward again in backward, collectives included (full and
    layer modes; the selective modes keep matmul and collective outputs)."""
    return cfg.mode in ("full", "layer") and is_checkpointed(layer_id, cfg)


def apply_ac(model: nn.Module, cfg: ActivationCheckpointConfig) -> None:
    """Checkpoint the blocks of ``model.layers`` that ``cfg`` selects, in place (after TP, before
    compile and FSDP). Blocks are keyed by their global layer index, so ``layer`` mode picks the same
    blocks on every pipeline layout."""
    for name, block in model.layers.items():  # type: ignore[union-attr]
        if is_checkpointed(int(name), cfg):
            block.forward = checkpointed(block.forward, "full" if cfg.mode == "layer" else cfg.mode)
