"""Model families and presets: which model a config names, and whether it can be built. Torch-free,
so a config is checked before torch loads; the modules themselves (``build_model``, ``Transformer``,
``init_weights``) are in :mod:`shardwise.models.transformer`."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.config.model_args import ModelArgs
from shardwise.config.types import ConfigError
from shardwise.models.presets import PRESETS

__all__ = ["PRESETS", "ModelArgs", "check_args", "model_args"]


def model_args(cfg: Any) -> ModelArgs:
    """The model a ``[model]`` config section (shardwise.config.schema.ModelConfig) describes: the preset
    named by ``cfg.name`` (none: ``""``, ModelArgs' defaults) with every field set in ``cfg`` applied
    over it."""
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                 if f.name != "name" and getattr(cfg, f.name) is not None}
    return dataclasses.replace(PRESETS[cfg.name] if cfg.name else ModelArgs(), **overrides)


def check_args(args: Any) -> None:
    """One-line errors for model shapes that cannot be built: ``args`` is a ModelArgs or a completed
    ``[model]`` section (the same fields; the config checks pass that, so no ModelArgs is made)."""
    if args.attn_qk_init_std <= 0:  # (0: every logit 0 until the first update)
        raise ConfigError(f"model.attn_qk_init_std={args.attn_qk_init_std} must be > 0")
    if args.kv_lora_rank > 0:  # latent attention (ModelArgs.mla)
        _check_mla(args)
    elif args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={args.n_kv_heads} must divide model.n_heads={args.n_heads}")
    elif args.head_size:
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
        _check_groups(args)
        if args.moe_router_lr_scale <= 0:  # (0 would freeze the router at its random init)
            raise ConfigError(f"model.moe_router_lr_scale={args.moe_router_lr_scale} must be > 0")
        if args.moe_router_init_std <= 0:  # (0: every expert ties, every token goes to experts 0..k-1)
            raise ConfigError(f"model.moe_router_init_std={args.moe_router_init_std} must be > 0")
        for name in ("moe_aux_coef", "moe_bias_rate", "moe_z_coef"):  # (a negative one pushes the wrong way)
            if getattr(args, name) < 0:
                raise ConfigError(f"model.{name}={getattr(args, name)} must be >= 0 (0: off)")
        if args.n_dense_layers >= args.n_layers:
            raise ConfigError(f"model.n_dense_layers={args.n_dense_layers} leaves no MoE block of "
                              f"model.n_layers={args.n_layers}: lower it or set n_experts=0")


def _check_mla(args: ModelArgs) -> None:
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"model.kv_lora_rank > 0 (latent attention) needs model.{name} > 0")
    if args.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={args.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if args.qk_norm:
        raise ConfigError("model.qk_norm is grouped-query attention's; latent attention "
                          "(model.kv_lora_rank > 0) norms its latents instead: set qk_norm=false")
    if args.q_lora_rank < 0:
        raise ConfigError(f"model.q_lora_rank={args.q_lora_rank} must be >= 0 (0: a full query projection)")


def _check_groups(args: ModelArgs) -> None:
    g, e = args.moe_n_groups, args.n_experts
    if g < 1 or e % g:
        raise ConfigError(f"model.moe_n_groups={g} must divide model.n_experts={e}")
    if not 1 <= args.moe_topk_groups <= g:
        raise ConfigError(f"model.moe_topk_groups={args.moe_topk_groups} must be between 1 and "
                          f"model.moe_n_groups={g}")
    if args.moe_top_k > args.moe_topk_groups * (e // g):
        raise ConfigError(f"model.moe_top_k={args.moe_top_k} is more experts than the "
                          f"moe_topk_groups={args.moe_topk_groups} groups of {e // g} hold")
