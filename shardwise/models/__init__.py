"""Model families and presets."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shardwise.config_types import ConfigError
from shardwise.model_args import ModelArgs
from shardwise.models.llama import Transformer, init_weights
from shardwise.models.presets import PRESETS

__all__ = ["PRESETS", "ModelArgs", "Transformer", "build_model", "check_args", "init_weights", "model_args"]


def model_args(cfg: Any) -> ModelArgs:
    """The model a ``[model]`` config section (shardwise.config.ModelConfig) describes: the preset
    named by ``cfg.name`` (none: ``""``, ModelArgs' defaults) with every field set in ``cfg`` applied
    over it."""
    key = tuple(vars(cfg).items())  # (the planner asks for the same section thousands of times)
    try:
        if (args := _MODEL_ARGS.get(key)) is not None:
            return args
    except TypeError:  # an unhashable value: not memoized
        key = None
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                 if f.name != "name" and getattr(cfg, f.name) is not None}
    args = dataclasses.replace(PRESETS[cfg.name] if cfg.name else ModelArgs(), **overrides)
    if key is not None and len(_MODEL_ARGS) < 64:
        _MODEL_ARGS[key] = args
    return args


_MODEL_ARGS: dict[tuple, ModelArgs] = {}
"""model_args by the section's field values (ModelArgs is frozen, so sharing one is safe)."""


def check_args(args: ModelArgs) -> None:
    """One-line errors for model shapes that cannot be built (the config checks call this)."""
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={args.n_kv_heads} must divide model.n_heads={args.n_heads}")
    if args.head_size:
        if args.head_size % 2:
            raise ConfigError(f"model.head_size={args.head_size} must be even (RoPE rotates pairs)")
    elif args.dim % args.n_heads or (args.dim // args.n_heads) % 2:
        raise ConfigError(f"model.dim={args.dim} must be n_heads={args.n_heads} times an even head dim")
    if args.ffn_hidden_size < 0:
        raise ConfigError(f"model.ffn_hidden_size={args.ffn_hidden_size} must be >= 0 (0: Llama's rule)")
    if args.n_experts:
        if args.moe_hidden_dim <= 0:
            raise ConfigError("model.n_experts > 0 needs model.moe_hidden_dim > 0 (the expert width)")
        if not 1 <= args.moe_top_k <= args.n_experts:
            raise ConfigError(f"model.moe_top_k={args.moe_top_k} must be between 1 and "
                              f"model.n_experts={args.n_experts}")
        if args.n_dense_layers >= args.n_layers:
            raise ConfigError(f"model.n_dense_layers={args.n_dense_layers} leaves no MoE block of "
                              f"model.n_layers={args.n_layers}: lower it or set n_experts=0")


class _SkipInitOnMeta(TorchFunctionMode):
    """Construction without torch's default initializers on meta tensors (nn.Linear's
    kaiming_uniform_, nn.Embedding's normal_, ...). On meta they compute nothing, yet they run
    through torch's Python reference kernels: half of a 70B or 405B model's build on meta (0.5 ->
    0.25 s here), which the planner and every rank pay. ``init_weights`` initializes every
    parameter once the model is materialized."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_model(args: ModelArgs, device: torch.device | str = "meta", **moe: Any) -> Transformer:
    """Construct the model; on ``meta`` (the default) no memory is allocated (nor initializers
    run: :class:`_SkipInitOnMeta`). ``moe``: sequences_per_step and sequence_group for the MoE
    balance loss (see Transformer)."""
    skip = _SkipInitOnMeta() if torch.device(device).type == "meta" else contextlib.nullcontext()
    with torch.device(device), skip:
        return Transformer(args, **moe)
