"""Model families and presets."""

from __future__ import annotations

import dataclasses

import torch

from shardwise.config import ModelConfig
from shardwise.models.llama import ModelArgs, Transformer, init_weights
from shardwise.models.presets import PRESETS

__all__ = ["PRESETS", "ModelArgs", "Transformer", "build_model", "init_weights", "model_args"]


def model_args(cfg: ModelConfig) -> ModelArgs:
    """The preset named by ``cfg.name`` with every field set in ``cfg`` applied over it."""
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                 if f.name != "name" and getattr(cfg, f.name) is not None}
    return dataclasses.replace(PRESETS[cfg.name], **overrides)


def build_model(args: ModelArgs, device: torch.device | str = "meta") -> Transformer:
    """Construct the model; on ``meta`` (the default) no memory is allocated."""
    with torch.device(device):
        return Transformer(args)
