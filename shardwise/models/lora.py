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

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.config.lora import LoRAConfig
from shardwise.config.model_args import ModelArgs
from shardwise.config.types import ConfigError
from shardwise.models.moe import Router
from shardwise.models.transformer import build_model

ADAPTERS = ("lora_a", "lora_b")
"""The parameter names an adapted linear adds (the last part of the full name)."""


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter (a module's class is swapped to this by :func:`apply_lora`,
    keeping its weight, hooks and place in the model)."""

    lora_a: nn.Parameter  # (r, in)
    lora_b: nn.Parameter  # (out, r)
    lora_scale: float
    colwise_style: ClassVar[type]
    """Its tensor-parallel styles (models/protocol.py): :class:`LoRAColwise`, :class:`LoRARowwise`."""
    rowwise_style: ClassVar[type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        low = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)  # (..., r) -> (..., out)
        return base + low * self.lora_scale


ALL_LINEAR = "all-linear"


def _leaves(model: nn.Module) -> dict[str, nn.Linear]:
    """Each plain linear of attention and the feed-forward by full name: not the output head's, nor
    an MoE router's gate (which chooses the experts; PEFT's all-linear would adapt it)."""
    gates = {id(m.gate) for m in model.modules() if isinstance(m, Router)}
    head = model.plan.head
    return {name: m for name, m in model.named_modules()
            if type(m) is nn.Linear and name != head and id(m) not in gates}


def targets_of(cfg: LoRAConfig, model: nn.Module) -> list[str]:
    """The leaf names ``cfg.targets`` adapts in ``model`` (``all-linear``: every linear but the head)."""
    if cfg.targets.strip() == ALL_LINEAR:
        return sorted({n.rpartition(".")[2] for n in _leaves(model)})
    return [t.strip() for t in cfg.targets.split(",") if t.strip()]


def check_targets(args: ModelArgs, cfg: LoRAConfig) -> str:
    """``cfg.targets`` against the model of ``args`` (built on meta): a name that is no linear of
    its family is refused in one line, and so is the output head (the fused loss multiplies the
    hidden states by its weight itself: an adapter there would be trained by nothing); one this
    model lacks (an MoE model's ``w1``-``w3`` where no dense or shared feed-forward exists) is left
    out. Returns the notice for an MoE model (its routed experts take no adapter yet, and what was
    left out), else ''."""
    model = build_model(args)
    head = model.plan.head
    here = {n.rpartition(".")[2] for n in _leaves(model)}
    family = here | {n.rpartition(".")[2] for n in _leaves(build_model(dataclasses.replace(
        args, n_experts=0, n_layers=1)))}
    targets = targets_of(cfg, model)
    if head in targets:
        raise ConfigError(f"lora.targets: the output head ('{head}') takes no adapter yet (the fused loss "
                          "reads its weight directly): drop it")
    if unknown := [t for t in targets if t not in family]:
        raise ConfigError(f"lora.targets: '{unknown[0]}' names no linear of this model; its linears are "
                          f"{', '.join(sorted(family))} (or all-linear)")
    if not (kept := [t for t in targets if t in here]):
        raise ConfigError(f"lora.targets: none of {cfg.targets} is a linear of this model (its routed "
                          f"experts take no adapter yet); its linears are {', '.join(sorted(here))}")
    absent = [t for t in targets if t not in here]
    if not args.n_experts and not absent:
        return ""
    missing = f"; this model has no {', '.join(absent)} linear" if absent else ""
    return (f"lora: the routed experts stay frozen (they take no adapter yet){missing}: adapting "
            f"{', '.join(kept)}")


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Give each linear named in ``cfg.targets`` an adapter and freeze every other parameter (on any
    device; meta before parallelize). Returns the adapted linears' names (:func:`check_targets`
    has said which targets the model lacks)."""
    targets = targets_of(cfg, model)
    linears = _leaves(model)
    adapted = [name for name in linears if name.rpartition(".")[2] in targets]
    if not adapted:
        raise ConfigError(f"lora.targets: none of {cfg.targets} is a linear of this model")
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


def check_frozen(model: nn.Module) -> None:
    """After parallelize: exactly the adapters train. A parallelism that wraps a parameter anew
    (``nn.Parameter(...)`` defaults to trainable) would otherwise train a base weight silently."""
    wrong = [n for n, p in model.named_parameters() if p.requires_grad != is_adapter(n)]
    if wrong:
        state = "frozen" if is_adapter(wrong[0]) else "trainable"
        raise RuntimeError(f"LoRA: after parallelize, '{wrong[0]}' is {state} ({len(wrong)} in all): a "
                           "parallelism re-created it without keeping requires_grad")


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


class LoRAColwise(ColwiseParallel):
    """torch's column-parallel linear, with the adapter split as its weight is: ``B`` by output rows
    like ``W`` (Shard(0)), ``A`` whole on every tp rank, so ``x A^T`` is computed once per rank and
    ``(x A^T) B^T`` is this rank's output columns; no communication beyond the base's."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, p in module.named_parameters(recurse=False):
            place = Replicate() if pname == "lora_a" else Shard(0)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(p, device_mesh, [place], src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad))


class LoRARowwise(RowwiseParallel):
    """torch's row-parallel linear, with ``A`` split by input columns like ``W`` (Shard(1)) and ``B``
    whole: ``x A^T`` is this rank's partial sum, and so is ``(x A^T) B^T``, reduced with the base's
    output in the one reduction the base already does."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not isinstance(module, nn.Linear):  # (torch calls it on every submodule: the adapter's dropout)
            return
        super()._partition_linear_fn(name, module, device_mesh)  # (the weight and bias)
        if isinstance(module, LoRALinear):
            for pname, place in (("lora_a", Shard(1)), ("lora_b", Replicate())):
                p = getattr(module, pname)
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, device_mesh, [place], src_data_rank=self.src_data_rank),
                    requires_grad=p.requires_grad))


LoRALinear.colwise_style, LoRALinear.rowwise_style = LoRAColwise, LoRARowwise  # (models/protocol.py)
