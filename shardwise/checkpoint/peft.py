"""LoRA adapters as PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``), the
layout ``peft.PeftModel.from_pretrained(base, folder)`` loads onto a transformers model:
:func:`export_adapter` writes a LoRA checkpoint's adapters alone (``convert --to-hf --adapter``),
:func:`load_adapter` starts a LoRA run's adapters from one (``checkpoint.initial_adapter``).

Names follow the HF mapping of the base weights (models/hf_config.py): our ``layers.0.attention.wq``
is HF's ``model.layers.0.self_attn.q_proj``, whose adapter PEFT saves as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. ``B``'s rows are the linear's
output rows, so the query and key projections' are permuted as their weights are (RoPE's layout).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from shardwise.checkpoint.manifest import (
    CheckpointError,
    manifest_lora,
    manifest_model,
    read_manifest,
    run_config,
)
from shardwise.checkpoint.reader import ModelTensors
from shardwise.config.outputs import umask
from shardwise.config.schema import read_config
from shardwise.config.types import ConfigError
from shardwise.models import ModelArgs
from shardwise.models.hf_config import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    from_rotate_half,
    hf_names,
    rope_rows,
    to_rotate_half,
)
from shardwise.models.lora import is_adapter
from shardwise.models.transformer import keep_shard

_PEFT_PREFIX = "base_model.model."
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def adapter_names(args: ModelArgs, held: set[str]) -> dict[str, str]:
    """Our adapter parameter name -> PEFT's saved name, for each adapter among ``held`` (a
    checkpoint's tensor names)."""
    out = {}
    for ours, hf in hf_names(args).items():
        stem = ours.removesuffix(".weight")
        if ours.endswith(".weight") and f"{stem}.lora_a" in held:
            theirs = _PEFT_PREFIX + hf.removesuffix(".weight")
            out[f"{stem}.lora_a"] = f"{theirs}.lora_A.weight"
            out[f"{stem}.lora_b"] = f"{theirs}.lora_B.weight"
    return out


def _hf_leaves(names: dict[str, str]) -> dict[str, str]:
    """Our linear's leaf name (``wq``) -> HF's (``q_proj``), over ``names`` (:func:`adapter_names`)."""
    return {ours.rsplit(".", 2)[-2]: theirs.rsplit(".", 3)[-3] for ours, theirs in names.items()}


def export_adapter(checkpoint: Path, out: Path, dtype: str = "bf16", checksums: bool = True) -> list[Path]:
    """Write checkpoint ``checkpoint``'s LoRA adapters as a PEFT folder at ``out``; the HF model they
    adapt (the run's ``checkpoint.initial_hf``, when it started from one) is recorded as PEFT's
    ``base_model_name_or_path``. Returns the files written."""
    from safetensors.torch import save_file

    manifest = read_manifest(checkpoint)
    config_toml = run_config(checkpoint)
    base = read_config(config_toml).checkpoint.initial_hf if config_toml else ""
    args, lora = manifest_model(manifest, checkpoint), manifest_lora(manifest, checkpoint)
    if lora is None:
        raise ConfigError(f"convert --adapter: checkpoint '{checkpoint}' holds no LoRA adapters (it trained "
                          "every weight): drop --adapter to export the model")
    state = ModelTensors(checkpoint, checksums)
    names = adapter_names(args, set(state.specs))
    if not names or (missing := sorted(n for n in state.specs if is_adapter(n) and n not in names)):
        what = f"'{missing[0]}' that the HF mapping has no name for" if names else "no adapter tensors"
        raise CheckpointError(f"checkpoint '{checkpoint}' records [lora] but holds {what}: it was damaged or "
                              "edited; load an earlier step-<N>")
    tensors = {theirs: rope_rows(f"{ours.removesuffix('.lora_b')}.weight", state[ours], args, to_rotate_half)
               if ours.endswith("lora_b") else state[ours] for ours, theirs in names.items()}
    tensors = {k: v.detach().to(_DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": sorted(set(_hf_leaves(names).values())),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "base_model_name_or_path": base, "inference_mode": True}
    out.mkdir(parents=True, exist_ok=True)
    files = [out / PEFT_WEIGHTS, out / PEFT_CONFIG]
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    files[1].write_text(json.dumps(config, indent=1))
    for f in files:
        os.chmod(f, 0o644 & ~umask())
    return files


@torch.no_grad()
def load_adapter(model: nn.Module, folder: Path, args: ModelArgs) -> int:
    """Fill this rank's adapters (any layout: each keeps its shard of the full tensor, as
    :func:`shardwise.checkpoint.hf.load_hf_weights` does for the base) from the PEFT LoRA folder
    ``folder`` (``checkpoint.initial_adapter``; its settings are the run's ``[lora]``). Returns the
    tensors loaded; a missing or misshapen one is one line."""
    from safetensors import safe_open

    field = "checkpoint.initial_adapter"
    mine = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    names = adapter_names(args, set(mine))
    with safe_open(str(folder / PEFT_WEIGHTS), framework="pt") as f:
        have = set(f.keys())
        for ours, theirs in names.items():
            if theirs not in have:
                raise ConfigError(f"{field} '{folder}' has no tensor '{theirs}': it adapts another model "
                                  "(or other linears than its adapter_config.json says)")
            full = f.get_tensor(theirs).float()
            if ours.endswith("lora_b"):  # (HF's RoPE row layout -> ours)
                full = rope_rows(f"{ours.removesuffix('.lora_b')}.weight", full, args, from_rotate_half)
            p = mine[ours]
            if tuple(full.shape) != tuple(p.shape):
                raise ConfigError(f"{field}: '{theirs}' has shape {tuple(full.shape)}, this model's adapter "
                                  f"needs {tuple(p.shape)}")
            keep_shard(p, full.to(p.device))  # (every rank read the same tensor: no communication)
    return len(names)
