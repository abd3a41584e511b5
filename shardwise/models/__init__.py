"""Model families and presets."""

from __future__ import annotations

import dataclasses

import torch

from shardwise.config import ConfigError, ModelConfig
from shardwise.models.llama import ModelArgs, Transformer, init_weights
from shardwise.models.presets import PRESETS

__all__ = ["PRESETS", "ModelArgs", "Transformer", "build_model", "init_weights", "model_args"]


def model_args(cfg: ModelConfig) -> ModelArgs:
    """The preset named by ``cfg.name`` with every field set in ``cfg`` applied over it."""
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                 if f.name != "name" and getattr(cfg, f.name) is not None}
    args = dataclasses.replace(PRESETS[cfg.name], **overrides)
    check_args(args)
    return args


def check_args(args: ModelArgs) -> None:
    """One-line errors for model shapes that cannot be built."""
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={args.n_kv_heads} must divide model.n_heads={args.n_heads}")
    if args.n_experts:
        if args.moe_hidden_dim <= 0:
            raise ConfigError("model.n_experts > 0 needs model.moe_hidden_dim > 0 (the expert width)")
        if not 1 <= args.moe_top_k <= args.n_experts:
            raise ConfigError(f"model.moe_top_k={args.moe_top_k} must be between 1 and "
                              f"model.n_experts={args.n_experts}")
        if args.n_dense_layers >= args.n_layers:
            raise ConfigError(f"model.n_dense_layers={args.n_dense_layers} leaves no MoE block of "
                              f"model.n_layers={args.n_layers}: lower it or set n_experts=0")


def build_model(args: ModelArgs, device: torch.device | str = "meta") -> Transformer:
    """Construct the model; on ``meta`` (the default) no memory is allocated."""
    with torch.device(device):
        return Transformer(args)
