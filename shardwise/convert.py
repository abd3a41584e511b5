"""Interchange with Hugging Face Llama checkpoints (``config.json`` + safetensors).

- :func:`export_hf`: a shardwise checkpoint (any layout; DCP gathers the shards) -> an HF folder
  that ``transformers.LlamaForCausalLM.from_pretrained`` loads, in bf16 or fp32.
- :func:`import_hf`: an HF Llama folder -> a weights-only shardwise checkpoint, to start training
  from with ``--checkpoint.path`` (optimizer, schedule and data start fresh).

Our attention uses Meta's interleaved RoPE pairs; HF's uses rotate-half, so the q/k projection rows
are permuted on the way out and back on the way in (an exact permutation: a round trip is lossless).
Conversion runs in one process and holds the whole model in host memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import CheckpointError, load_model_only, read_manifest, save_model_only
from shardwise.config import ConfigError, ModelConfig
from shardwise.models import ModelArgs, build_model, model_args

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SHARD_BYTES = 5 << 30  # split safetensors files at this size, as HF's save_pretrained does
_LAYER = {  # ours (under layers.<i>.) -> HF (under model.layers.<i>.)
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows: interleaved RoPE pairs (ours) -> rotate-half halves (HF), per head."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def from_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_rotate_half`."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def hf_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> the HF Llama name, for every parameter of ``args``'s model."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{hf}" for ours, hf in _LAYER.items()})
    return names


def _rope_rows(name: str, w: torch.Tensor, args: ModelArgs, permute: Any) -> torch.Tensor:
    """``permute`` (either direction) applied to the q/k projections, other weights unchanged."""
    if name.endswith("wq.weight"):
        return permute(w, args.n_heads)
    if name.endswith("wk.weight"):
        return permute(w, args.n_kv_heads)
    return w


def to_hf_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return {hf: _rope_rows(ours, state[ours], args, to_rotate_half) for ours, hf in hf_names(args).items()}


def from_hf_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    names = hf_names(args)
    if missing := next((hf for hf in names.values() if hf not in state), None):
        raise ConfigError(f"the HF checkpoint has no tensor '{missing}': is it a Llama checkpoint of "
                          "this model config?")
    return {ours: _rope_rows(ours, state[hf], args, from_rotate_half) for ours, hf in names.items()}


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with ``args``'s shape."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_theta": args.rope_theta,
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if args.rope_scaling_factor != 1.0:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                               "low_freq_factor": args.rope_low_freq_factor,
                               "high_freq_factor": args.rope_high_freq_factor,
                               "original_max_position_embeddings": args.rope_original_max_seq_len}
    return cfg


def check_hf_config(hf: dict[str, Any], args: ModelArgs) -> None:
    """One-line error for the first HF config field that disagrees with our model config."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta"))
    factor = rope.get("factor", 1.0) if rope.get("rope_type", rope.get("type")) == "llama3" else 1.0
    pairs = [("hidden_size", hf.get("hidden_size"), "model.dim", args.dim),
             ("num_hidden_layers", hf.get("num_hidden_layers"), "model.n_layers", args.n_layers),
             ("num_attention_heads", hf.get("num_attention_heads"), "model.n_heads", args.n_heads),
             ("num_key_value_heads", hf.get("num_key_value_heads", hf.get("num_attention_heads")),
              "model.n_kv_heads", args.n_kv_heads),
             ("head_dim", hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
              "model.head_size", args.head_dim),
             ("vocab_size", hf.get("vocab_size"), "model.vocab_size", args.vocab_size),
             ("intermediate_size", hf.get("intermediate_size"), "the FFN width (model.multiple_of / "
              "ffn_dim_multiplier)", args.ffn_hidden_dim),
             ("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False)), "model.tie_embeddings",
              args.tie_embeddings),
             ("rope_theta", theta, "model.rope_theta", args.rope_theta),
             ("rope factor", factor, "model.rope_scaling_factor", args.rope_scaling_factor)]
    for hf_key, hf_val, our_key, our_val in pairs:
        same = math.isclose(hf_val, our_val) if isinstance(our_val, float) and hf_val is not None \
            else hf_val == our_val
        if not same:
            raise ConfigError(f"HF config {hf_key}={hf_val} but {our_key} gives {our_val}: set "
                              f"{our_key} to match (--{our_key}={hf_val})" if our_key.startswith("model.")
                              else f"HF config {hf_key}={hf_val} but {our_key} gives {our_val}")
    if abs(hf.get("rms_norm_eps", args.norm_eps) - args.norm_eps) > 1e-12:
        raise ConfigError(f"HF config rms_norm_eps={hf['rms_norm_eps']} but model.norm_eps="
                          f"{args.norm_eps}: set --model.norm_eps={hf['rms_norm_eps']}")


def _check_dense(args: ModelArgs) -> None:
    if args.n_experts:
        raise ConfigError("HF conversion covers dense Llama models; this model has MoE blocks "
                          "(model.n_experts > 0)")


def export_hf(checkpoint: Path, out: Path, dtype: str = "bf16") -> list[Path]:
    """Write ``out/config.json`` and safetensors (sharded above 5 GiB) from a shardwise checkpoint."""
    from safetensors.torch import save_file

    manifest = read_manifest(checkpoint)
    if "model" not in manifest:
        raise CheckpointError(f"checkpoint '{checkpoint}' records no model config in its manifest")
    args = model_args(ModelConfig(**manifest["model"]))
    _check_dense(args)
    model = build_model(args)
    model.to_empty(device="cpu")
    load_model_only(checkpoint, model)
    tensors = {k: v.detach().to(_DTYPES[dtype]).contiguous()
               for k, v in to_hf_state(model.state_dict(), args).items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=1))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        files = [out / "model.safetensors"]
    else:
        files = [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: f.name for f, s in zip(files, shards, strict=True) for n in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for f, shard in zip(files, shards, strict=True):
        save_file(shard, str(f), metadata={"format": "pt"})
    return files


def read_hf(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, every tensor of every safetensors file) of an HF model folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not (folder / "config.json").is_file():
        raise ConfigError(f"'{folder}' has no config.json: pass an HF model folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"'{folder}' has no .safetensors files (only safetensors weights are read)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"'{f}' is not a readable safetensors file ({e})") from None
    return json.loads((folder / "config.json").read_text()), state


def import_hf(folder: Path, out: Path, model_cfg: ModelConfig) -> Path:
    """Write a weights-only shardwise checkpoint (fp32) at ``out`` from an HF Llama folder."""
    from dataclasses import asdict

    args = model_args(model_cfg)
    _check_dense(args)
    hf, state = read_hf(folder)
    check_hf_config(hf, args)
    ours = from_hf_state(state, args)
    expected = build_model(args).state_dict()
    for name, meta in expected.items():
        if tuple(ours[name].shape) != tuple(meta.shape):
            raise ConfigError(f"HF tensor for '{name}' has shape {tuple(ours[name].shape)}, this model "
                              f"needs {tuple(meta.shape)}")
    save_model_only(out, {k: v.to(torch.float32).contiguous() for k, v in ours.items()},
                    {"model": asdict(model_cfg), "source": str(folder)})
    return out
