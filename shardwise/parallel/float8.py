"""FP8 training with per-tensor current scaling, on torchao's float8 linear.

Each converted ``nn.Linear`` runs its three GEMMs through ``torch._scaled_mm``: inputs and weights
cast to E4M3, output gradients to E5M2, each with a scale ``fp8_max / amax`` computed from the
*current* tensor every step (no amax history). This module decides what to convert and keeps the
pieces consistent across layouts:

- **What**: the linear groups each block declares (``block.plan.groups``: for Llama, attention's
  wq, wk, wv, wo and the MLP's or shared expert's w1, w2, w3), as whole groups, when all of a
  group's local GEMM dims are multiples of 16 (a ``_scaled_mm`` requirement) and at least
  ``float8.min_dim``. The output head, the embedding and what a block keeps in high precision
  (``block.plan.high_precision``: the MoE router, the grouped experts) are left alone.
- **Tensor / sequence parallel**: :func:`tp_styles` gives torchao's float8 TP styles, which cast
  the sequence-sharded input to float8 *before* the all-gather: the amax is reduced over the TP
  group first, so every rank uses one scale (and the all-gather moves half the bytes). On gloo,
  which cannot carry float8, the gather is in high precision and the cast follows it.
- **FSDP**: with ``float8.fsdp_all_gather`` weights are cast before FSDP's all-gather; their
  scales are computed for all weights in one all-reduce after each optimizer step
  (:func:`precompute_scales`). Each scale gets its own allocation: torchao returns them as views
  into one tensor at 4-byte offsets, and cuBLAS on CUDA >= 12.9 rejects scale pointers that are
  not 16-byte aligned.

torchao is imported only when float8 is enabled (it logs warnings about optional CUDA extensions
at import).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from shardwise.config.extras import require_extra
from shardwise.config.schema import ConfigError, Float8Config
from shardwise.models.protocol import LinearGroup


def _torchao() -> Any:
    require_extra("float8", "float8.enabled=true")
    # Quiet import: torchao logs each optional CUDA extension it cannot load, and torch's pytree
    # warns about an Enum torchao registers.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        pytree_log.setLevel(level)

    return torchao.float8


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` (False while torchao is not imported)."""
    mod = sys.modules.get("torchao.float8.float8_linear")
    return mod is not None and isinstance(module, mod.Float8Linear)


def float8_groups(model: nn.Module, cfg: Float8Config, tp: int) -> list[str]:
    """Fully qualified names of the linear groups to convert, given the tensor-parallel degree
    (a group is converted whole: its TP styles cast the shared input once)."""
    return list(float8_choice(model, cfg, tp)[0])


def float8_choice(model: nn.Module, cfg: Float8Config, tp: int
                  ) -> tuple[dict[str, LinearGroup], dict[str, str], list[str]]:
    """({group to convert: its plan}, {module or group left in high precision: why}, the groups
    refused for their dims, in order). The GEMM dims tensor parallel divides are the column-parallel
    outputs and the row-parallel inputs."""
    out, kept, refused = {}, {}, []
    for name, block in model.layers.items():  # type: ignore[union-attr]
        plan = block.plan
        for group in plan.groups:
            parent = block.get_submodule(group.region)
            linears = {n: getattr(parent, n) for n in (*group.columns, *group.rows)}
            if not all(isinstance(m, nn.Linear) for m in linears.values()):
                continue  # (a plan naming something else: nothing float8 can convert)
            split = tp if group.split else 1
            dims = []
            for n, m in linears.items():
                out_f, in_f = m.out_features, m.in_features
                dims += [(n, "out", out_f // split if n in group.columns else out_f),
                         (n, "in", in_f // split if n in group.rows else in_f)]
            bad = [(n, side, d) for n, side, d in dims if d % 16 or d < cfg.min_dim]
            fqn = f"layers.{name}.{group.region}"
            if not bad:
                out[fqn] = group
            else:
                n, side, d = min(bad, key=lambda b: b[2])
                local = f" per tp rank (tp={tp})" if split > 1 else ""
                kept[fqn] = (f"{n} has {d} {side}put features{local}: float8 needs multiples of 16 "
                             f"and >= float8.min_dim={cfg.min_dim}")
                refused.append(fqn)
        kept.update({f"layers.{name}.{sub}": why for sub, why in plan.high_precision.items()})
    if getattr(model, model.plan.head, None) is not None:
        kept[model.plan.head] = "the output head stays in high precision (the loss is sensitive to it)"
    return out, kept, refused


def float8_summary(model: nn.Module, cfg: Float8Config, tp: int) -> str:
    """One line for the log: what float8.enabled converts and what it keeps in high precision and
    why; a one-line error when it would convert nothing."""
    groups, kept, refused = float8_choice(model, cfg, tp)
    if not groups:
        first, why = (refused[0], kept[refused[0]]) if refused else ("", "the model has no linear groups")
        raise ConfigError(f"float8.enabled=true converts no linear ({first}: {why}): lower float8.min_dim, "
                          "widen the model, or set float8.enabled=false")
    linears = sum(len(g.columns) + len(g.rows) for g in groups.values())
    per_block = lambda name: re.sub(r"^layers\.\d+\.", "layers.<i>.", name)  # noqa: E731
    converted = Counter(per_block(g) for g in groups)
    left = Counter((per_block(k), why) for k, why in kept.items())
    return (f"float8: {linears} linears in {len(groups)} groups run in float8, {cfg.recipe} scaling ("
            + ", ".join(f"{g} x{n}" for g, n in converted.items()) + "); kept in high precision: "
            + "; ".join(f"{g} x{n}: {why}" for (g, why), n in left.items()))


def apply_float8(model: nn.Module, cfg: Float8Config, tp: int, device_type: str) -> list[str]:
    """Swap the selected groups' linears for float8 ones in place (on meta, before TP/FSDP);
    returns the converted group names.

    On CUDA the GEMMs are ``torch._scaled_mm`` (needs compute capability >= 8.9: Ada, Hopper and
    later). Elsewhere they are emulated: the same float8 casts and scales, the matmul in high
    precision on the dequantized values -- the numerics of float8 training without its speed.
    (CPU ``_scaled_mm`` exists but is a reference loop, ~1000x slower than a float32 matmul.)
    """
    if not cfg.enabled:
        return []
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError(f"float8.enabled needs a GPU of compute capability >= 8.9 (this one is "
                          f"{torch.cuda.get_device_capability()}): set float8.enabled=false")
    if device_type == "cuda" and cfg.recipe == "rowwise" and torch.cuda.get_device_capability() < (9, 0):
        raise ConfigError("float8.recipe=rowwise needs a GPU of compute capability >= 9.0 (the "
                          "rowwise _scaled_mm): set float8.recipe=tensorwise")
    ao = _torchao()
    groups = float8_groups(model, cfg, tp)
    # The recipe's casts (rowwise: per-row E4M3 with power-of-2 scales), then this run's settings.
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(cfg.recipe),
                                 enable_fsdp_float8_all_gather=cfg.fsdp_all_gather,
                                 emulate=device_type != "cuda")

    def keep(module: nn.Module, fqn: str) -> bool:
        return any(fqn.startswith(g + ".") and fqn.count(".") == g.count(".") + 1 for g in groups)

    ao.convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return groups


def tp_styles(parent: nn.Module, col: str, float8_comm: bool) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) TP styles for a linear group whose column-parallel member
    is ``parent.<col>``: torchao's float8 styles when the group was converted and the TP group's
    backend can move float8 tensors (NCCL), else torch's.

    gloo has no float8 dtypes, so there the input is all-gathered in high precision and cast after
    the gather: every rank then computes the amax over the same full tensor, which gives the same
    single scale (at twice the all-gather bytes)."""
    if float8_comm and is_float8(getattr(parent, col)) and tensorwise(getattr(parent, col)):
        import torchao.float8.float8_tensor_parallel as tp  # already loaded with torchao

        return tp.Float8ColwiseParallel, tp.Float8RowwiseParallel, tp.PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def tensorwise(linear: nn.Module) -> bool:
    """A float8 linear with one scale per tensor (torchao's float8 TP styles cast and gather only
    those; a rowwise linear is gathered in high precision and cast after)."""
    ao = _torchao()
    return linear.config.cast_config_input.scaling_granularity is ao.ScalingGranularity.TENSORWISE


def gathers_float8(model: nn.Module, cfg: Float8Config) -> bool:
    """Whether FSDP all-gathers float8 weights (float8.fsdp_all_gather and a converted linear):
    the trainer then precomputes their scales after each optimizer step."""
    return cfg.enabled and cfg.fsdp_all_gather and any(is_float8(m) for m in model.modules())


@torch.no_grad()
def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step, with ``float8.fsdp_all_gather``: every float8 weight's scale from
    one all-reduce of the amaxes (torchao), each scale then moved to its own 16-byte aligned
    allocation."""
    ao = _torchao()
    ao.precompute_float8_dynamic_scale_for_fsdp(model)
    for w in float8_weights(model):
        scale = w._local_tensor._precomputed_scale
        if scale is not None:
            w._local_tensor._precomputed_scale = scale.clone()  # a fresh, aligned allocation


def float8_weights(model: nn.Module) -> list[DTensor]:
    """The DTensor weights of float8 linears that FSDP all-gathers in float8."""
    return [m.weight for m in model.modules() if is_float8(m) and isinstance(m.weight, DTensor)
            and hasattr(m.weight._local_tensor, "_precomputed_scale")]
