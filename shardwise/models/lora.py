"""LoRA: low-rank adapters on a frozen base (``[lora]``, shardwise/config/lora.py).

Each target linear keeps its weight ``W`` (out x in), frozen, and gains ``lora_a`` (r x in, drawn as
PEFT draws it) and ``lora_b`` (out x r, zero), the only parameters that train:

    y = x W^T + (alpha / r) * dropout(x) A^T B^T

so step 0 computes what the base model computes. The adapters live in the linear itself (their
names are ``<linear>.lora_a`` / ``.lora_b``), so FSDP2 shards them in the same units as their base
weights, and a checkpoint holds base and adapters side by side (exact resume). Applied on meta,
before parallelize, by trainer/build.py; :func:`merged` folds them into ``W`` for an export.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config.lora import LoRAConfig
from shardwise.config.types import ConfigError

ADAPTERS = ("lora_a", "lora_b")
"""The parameter names an adapted linear adds (the last part of the full name)."""


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter (a module's class is swapped to this by :func:`apply_lora`,
    keeping its weight, hooks and place in the model)."""

    lora_a: nn.Parameter  # (r, in)
    lora_b: nn.Parameter  # (out, r)
    lora_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        low = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)  # (..., r) -> (..., out)
        return base + low * self.lora_scale


def targets_of(cfg: LoRAConfig) -> list[str]:
    return [t.strip() for t in cfg.targets.split(",") if t.strip()]


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Give each linear named in ``cfg.targets`` an adapter and freeze every other parameter (on any
    device; meta before parallelize). Returns the adapted linears' names. A target that names no
    linear of ``model`` is refused in one line."""
    targets = targets_of(cfg)
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    leaves = {name.rpartition(".")[2] for name in linears}
    if missing := [t for t in targets if t not in leaves]:
        raise ConfigError(f"lora.targets: '{missing[0]}' names no linear of this model; its linears are "
                          f"{', '.join(sorted(leaves))}")
    adapted = [name for name in linears if name.rpartition(".")[2] in targets]
    for p in model.parameters():
        p.requires_grad_(False)
    for name in adapted:
        m = linears[name]
        device = m.weight.device
        m.__class__ = LoRALinear
        m.lora_a = nn.Parameter(torch.empty(cfg.rank, m.in_features, device=device))
        m.lora_b = nn.Parameter(torch.empty(m.out_features, cfg.rank, device=device))
        m.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        m.lora_scale = cfg.alpha / cfg.rank
    return adapted


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's."""
    return name.rpartition(".")[2] in ADAPTERS


def merged(get: Callable[[str], torch.Tensor], names: set[str], rank: int, alpha: float
           ) -> Callable[[str], torch.Tensor]:
    """``get`` (name -> full tensor of a checkpoint) with each adapted weight read as
    ``W + (alpha / rank) B A`` (in fp32), for a plain model's names; ``names`` are the checkpoint's."""
    def get_merged(name: str) -> torch.Tensor:
        w = get(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_a" not in names:
            return w
        a, b = get(f"{stem}.lora_a").float(), get(f"{stem}.lora_b").float()
        return (w.float() + (alpha / rank) * (b @ a)).to(w.dtype)
    return get_merged


@torch.no_grad()
def fold_lora(model: nn.Module) -> None:
    """Fold every adapter of a plain (unparallelized) ``model`` into its weight,
    ``W + (alpha / r) B A``, leaving plain linears: the model an export of it computes."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.weight += m.lora_scale * (m.lora_b.float() @ m.lora_a.float()).to(m.weight.dtype)
            del m.lora_a, m.lora_b, m.lora_dropout
            m.__class__ = nn.Linear


def flops_change_per_token(model: nn.Module, matmul_params: int) -> float:
    """What LoRA changes in a training step's FLOPs per token (``model``: a rank's, any layout; its
    linears keep their full shapes): the frozen weights' gradients are not computed, 2 FLOPs per
    element of the ``matmul_params`` weights; each adapter's two matmuls run forward (2) and backward
    (4, input and adapter gradients), 6 FLOPs per adapter element, r * (in + out) a linear."""
    adapters = sum(m.lora_a.shape[0] * (m.in_features + m.out_features)
                   for m in model.modules() if isinstance(m, LoRALinear))
    return 6.0 * adapters - 2.0 * matmul_params if adapters else 0.0
