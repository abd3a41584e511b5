"""The model shape of a Hugging Face ``config.json`` and back, for the families
:mod:`shardwise.checkpoint.hf` speaks (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3). Plain data: the config
checks use it to take a run's model from an HF folder (``checkpoint.initial_hf``) without loading the
converter."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.config.model_args import TRAINING_CHOICES
from shardwise.config.schema import ConfigError, ModelConfig
from shardwise.models import ModelArgs, check_args
from shardwise.models.presets import PRESETS

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}
# ModelArgs fields an HF config does not fix: the training choices, and how MoE routing is balanced
# (HF's config has no routing bias state to compare).
_TRAINING_ONLY = (*TRAINING_CHOICES, "moe_balance")


def read_hf_config(folder: Path) -> dict[str, Any]:
    """An HF model folder's ``config.json`` (one-line error when it has none)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{folder}' has no config.json: pass a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"'{path}' is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"'{path}' holds a JSON {type(config).__name__}, not an object of model settings: "
                          "pass a Hugging Face model folder")
    return config


_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
"""The config.json fields every family's shape needs, each a positive integer."""


def hf_tokenizer(folder: Path) -> str:
    """``folder`` as a data.tokenizer when it holds a tokenizer.json (its tokenizer_config.json --
    special tokens, chat template -- comes with it), else "" (the shipped tokenizer)."""
    return str(folder) if (Path(folder) / "tokenizer.json").is_file() else ""


def hf_family(args: ModelArgs) -> str:
    """The HF ``model_type`` a shape exports as (one-line error for a shape none of them has)."""
    if args.mla:
        why = ("model.n_experts=0" if not args.n_experts else
               "model.n_shared_experts=0" if not args.n_shared_experts else
               f"model.moe_score={args.moe_score}" if args.moe_score != "sigmoid" else
               f"model.rope_scaling={args.rope_scaling}" if args.rope_scaling_factor != 1.0
               and args.rope_scaling != "yarn" else "")
        if why:
            raise ConfigError(f"HF export of latent attention covers the DeepSeek-V3 layout (MoE with shared "
                              f"experts, sigmoid routing, YaRN if scaled); this model has {why}")
        return "deepseek_v3"
    if not args.n_experts:
        return "qwen3" if args.qk_norm else "llama"
    why = ("model.qk_norm=false" if not args.qk_norm else
           f"model.n_shared_experts={args.n_shared_experts}" if args.n_shared_experts else
           f"model.moe_score={args.moe_score}" if args.moe_score != "softmax" else
           f"model.moe_route_scale={args.moe_route_scale}" if args.moe_route_scale != 1.0 else "")
    if why:
        raise ConfigError(f"HF export of MoE models covers the Qwen3-MoE layout (QK-norm, softmax "
                          f"routing, no shared expert, route scale 1); this model has {why}")
    return "qwen3_moe"


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """``config.json`` of the HF class with ``args``'s shape (:func:`hf_family`)."""
    family = hf_family(args)
    if family == "deepseek_v3":
        return _deepseek_config(args, dtype)
    cfg: dict[str, Any] = {
        "architectures": [_CLASSES[family]], "model_type": family, "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "rope_theta": args.rope_theta,
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if family == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg["use_sliding_window"] = False
    if family == "qwen3_moe":
        cfg.update(num_experts=args.n_experts, num_experts_per_tok=args.moe_top_k,
                   moe_intermediate_size=args.moe_hidden_dim, norm_topk_prob=args.moe_route_norm,
                   decoder_sparse_step=1, mlp_only_layers=list(range(args.n_dense_layers)),
                   router_aux_loss_coef=args.moe_aux_coef, output_router_logits=False)
    if args.rope_scaling_factor != 1.0:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                               "low_freq_factor": args.rope_low_freq_factor,
                               "high_freq_factor": args.rope_high_freq_factor,
                               "original_max_position_embeddings": args.rope_original_max_seq_len}
    return cfg


def _deepseek_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [_CLASSES["deepseek_v3"]], "model_type": "deepseek_v3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "moe_intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads, "n_shared_experts": args.n_shared_experts,
        "n_routed_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
        "routed_scaling_factor": args.moe_route_scale, "n_group": args.moe_n_groups,
        "topk_group": args.moe_topk_groups, "first_k_dense_replace": args.n_dense_layers,
        "norm_topk_prob": args.moe_route_norm, "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None, "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim, "v_head_dim": args.v_head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "rope_interleave": True, "rope_theta": args.rope_theta,
        "num_nextn_predict_layers": 0, "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if args.rope_scaling_factor != 1.0:
        cfg["rope_scaling"] = {"type": "yarn", "factor": args.rope_scaling_factor,
                               "original_max_position_embeddings": args.rope_original_max_seq_len,
                               "beta_fast": args.rope_yarn_beta_fast, "beta_slow": args.rope_yarn_beta_slow,
                               "mscale": args.rope_yarn_mscale,
                               "mscale_all_dim": args.rope_yarn_mscale_all_dim}
    return cfg


def _rope(hf: dict[str, Any]) -> tuple[dict[str, Any], str, float]:
    """(rope scaling dict, its type, rope theta) of an HF config (transformers 4 and 5 spellings)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    return rope, kind, float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))


def args_from_hf(hf: dict[str, Any]) -> ModelArgs:
    """The model shape of an HF ``config.json`` (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3), or a one-line
    error naming what this model family cannot represent, or the field that is missing or wrong."""
    kind = hf.get("model_type")
    if kind not in _CLASSES:
        raise ConfigError(f"HF model_type '{kind}' is not supported: convert reads "
                          f"{', '.join(_CLASSES)} (Llama, Qwen3, Qwen3-MoE and DeepSeek-V3 checkpoints)")
    for key in _SIZES:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            said = "missing" if key not in hf else f"{value!r}"
            raise ConfigError(f"HF config.json field '{key}' is {said}: a {kind} config.json gives it as a "
                              "positive integer (is this the model's own config.json?)")
    try:
        return _args_from_hf(hf, kind)
    except KeyError as e:
        raise ConfigError(f"HF config.json has no '{e.args[0]}', which a {kind} config.json gives") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"HF config.json has a value of the wrong kind for a {kind} model ({e})") from None


def _args_from_hf(hf: dict[str, Any], kind: str) -> ModelArgs:
    """:func:`args_from_hf` once the sizes are known to be there."""
    for key, bad in (("hidden_act", hf.get("hidden_act", "silu") != "silu"),
                     ("attention_bias", bool(hf.get("attention_bias"))),
                     ("mlp_bias", bool(hf.get("mlp_bias"))),
                     ("use_sliding_window", bool(hf.get("use_sliding_window")))):
        if bad:
            raise ConfigError(f"HF config {key}={hf.get(key)} is not supported (SwiGLU with silu, no "
                              "biases, full attention)")
    rope, rope_type, theta = _rope(hf)
    allowed = ("default", "yarn") if kind == "deepseek_v3" else ("default", "llama3")
    if rope_type not in allowed:
        raise ConfigError(f"HF config rope type '{rope_type}' is not supported for {kind} "
                          f"({' and '.join(allowed)} are)")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = dim // heads if kind == "deepseek_v3" else hf.get("head_dim") or dim // heads
    fields: dict[str, Any] = dict(
        dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=0 if head_dim * heads == dim else head_dim, vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=kind != "llama")
    if rope_type == "llama3":
        fields.update(rope_scaling_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                      rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                      rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    if rope_type == "yarn":
        fields.update(rope_scaling="yarn", rope_scaling_factor=float(rope["factor"]),
                      rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
                      rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
                      rope_yarn_beta_slow=float(rope.get("beta_slow") or 1),
                      rope_yarn_mscale=float(rope.get("mscale") or 1.0),
                      rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    if kind == "deepseek_v3":
        fields.update(_deepseek_fields(hf))
    if kind == "qwen3_moe":
        dense = list(hf.get("mlp_only_layers") or [])
        if hf.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
            raise ConfigError("HF Qwen3-MoE config with dense blocks other than the first "
                              f"(mlp_only_layers={dense}, decoder_sparse_step="
                              f"{hf.get('decoder_sparse_step')}) is not supported")
        fields.update(n_experts=hf.get("num_experts") or hf["num_local_experts"],  # (transformers 5)
                      moe_top_k=hf["num_experts_per_tok"],
                      moe_hidden_dim=hf["moe_intermediate_size"],
                      moe_route_norm=bool(hf.get("norm_topk_prob", False)), moe_score="softmax",
                      moe_aux_coef=float(hf.get("router_aux_loss_coef", 0.001)), n_dense_layers=len(dense))
    args = ModelArgs(**fields)
    check_args(args)
    return args


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's latent attention and routing (its other fields read as the other families')."""
    if hf.get("rope_interleave", True) is False:
        raise ConfigError("HF DeepSeek-V3 config rope_interleave=false is not supported (the "
                          "published checkpoints rotate interleaved pairs)")
    # (a multi-token-prediction layer, num_nextn_predict_layers, is not read: transformers skips it too)
    n_experts = hf.get("n_routed_experts") or hf.get("num_local_experts")
    return dict(
        qk_norm=False, n_kv_heads=hf["num_attention_heads"], head_size=0,
        q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], n_experts=n_experts, moe_top_k=hf["num_experts_per_tok"],
        moe_hidden_dim=hf["moe_intermediate_size"], n_shared_experts=hf.get("n_shared_experts") or 0,
        moe_score="sigmoid", moe_route_norm=bool(hf.get("norm_topk_prob", True)),
        moe_route_scale=float(hf.get("routed_scaling_factor", 1.0)),
        moe_n_groups=hf.get("n_group") or 1, moe_topk_groups=hf.get("topk_group") or 1,
        n_dense_layers=min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]),
        moe_balance="bias")


def model_config_of(args: ModelArgs) -> ModelConfig:
    """A ``[model]`` section that gives ``args`` by itself: every field set, and the name of a preset
    with the same HF shape where there is one (else "", none)."""
    def same(preset: ModelArgs) -> bool:
        try:
            return hf_config(preset, "fp32") == hf_config(args, "fp32")
        except ConfigError:  # a preset with no HF family
            return False

    name = next((n for n, p in PRESETS.items() if same(p)), "")
    return ModelConfig(name=name, **dataclasses.asdict(args))


def check_hf_config(hf: dict[str, Any], args: ModelArgs) -> None:
    """One-line error for the first field where an HF config's shape differs from ``args``."""
    theirs = args_from_hf(hf)
    for f in dataclasses.fields(ModelArgs):
        a, b = getattr(theirs, f.name), getattr(args, f.name)
        if f.name.startswith("moe_") and not args.n_experts or f.name in _TRAINING_ONLY:
            continue  # (a dense model's MoE knobs are inert; training choices are not the shape)
        if (f.name.startswith("rope_yarn") or f.name == "rope_scaling") and args.rope_scaling_factor == 1.0:
            continue  # (no scaling: its kind and YaRN's knobs are inert)
        if f.name in ("n_kv_heads", "head_size") and args.mla:
            continue  # (latent attention expands its latent into every head)
        if f.name in ("multiple_of", "ffn_dim_multiplier", "ffn_hidden_size", "head_size"):
            continue  # compared through what they give: the FFN width and the head width below
        if (math.isclose(a, b) if isinstance(a, float) else a == b):
            continue
        raise ConfigError(f"HF config gives model.{f.name}={a} but the model config has {b}: set "
                          f"--model.{f.name}={a}, or drop --config to take the shape from config.json")
    for what, a, b in (("ffn_hidden_size", theirs.ffn_hidden_dim, args.ffn_hidden_dim),
                       ("head_size", theirs.head_dim, args.head_dim) if not args.mla else ("", 0, 0)):
        if a != b:
            raise ConfigError(f"HF config gives model.{what}={a} but the model config gives {b}: set "
                              f"--model.{what}={a}, or drop --config to take the shape from config.json")


# ---------------------------------------------------------------------------------------------
# Tensor names: ours -> HF's (the checkpoint converter streams tensors through these)

_LAYER = {  # ours (under layers.<i>.) -> HF (under model.layers.<i>.)
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QK_NORM = {"attention.q_norm.weight": "self_attn.q_norm.weight",
            "attention.k_norm.weight": "self_attn.k_norm.weight"}
_DENSE_FFN = {"feed_forward.w1.weight": "mlp.gate_proj.weight",
              "feed_forward.w2.weight": "mlp.down_proj.weight",
              "feed_forward.w3.weight": "mlp.up_proj.weight"}
_LATENT = {  # multi-head latent attention (DeepSeek-V3)
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LOW_RANK_Q = {"attention.wq_a.weight": "self_attn.q_a_proj.weight",
               "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
               "attention.wq_b.weight": "self_attn.q_b_proj.weight"}
_FULL_Q = {"attention.wq.weight": "self_attn.q_proj.weight"}
_SHARED = {"feed_forward.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
           "feed_forward.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
           "feed_forward.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight"}
_ROUTER = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
_ROUTING_BIAS = {"feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias"}
_EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
            "feed_forward.experts.w2": "down_proj"}  # ours (E, in, out); HF experts.<e>.<name> (out, in)


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows: interleaved RoPE pairs (ours) -> rotate-half halves (HF), per head."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def from_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_rotate_half`."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def hf_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> the HF name, for every tensor that maps one to one (an MoE block's
    experts map to one HF tensor per expert: :func:`expert_names`); DeepSeek-V3's also name the
    routing bias, a buffer of ours."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        if args.mla:
            attention = {**_LATENT, **(_LOW_RANK_Q if args.q_lora_rank else _FULL_Q)}
        else:
            attention = {**_LAYER, **(_QK_NORM if args.qk_norm else {})}
        moe = {**_ROUTER, **(_SHARED if args.n_shared_experts else {}),
               **(_ROUTING_BIAS if args.mla else {})}  # (DeepSeek-V3 checkpoints carry the bias)
        layer = {**attention, **(moe if args.is_moe_layer(i) else _DENSE_FFN)}
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{hf}" for ours, hf in layer.items()})
    return names


def expert_names(args: ModelArgs) -> dict[str, list[str]]:
    """Our (E, in, out) expert tensor -> its E HF per-expert matrices, in expert order."""
    return {f"layers.{i}.{ours}": [f"model.layers.{i}.mlp.experts.{e}.{hf}.weight"
                                   for e in range(args.n_experts)]
            for i in range(args.n_layers) if args.is_moe_layer(i) for ours, hf in _EXPERTS.items()}


def rope_rows(name: str, w: torch.Tensor, args: ModelArgs, permute: Callable) -> torch.Tensor:
    """``permute`` (either direction) applied to the q/k projections and QK-norm weights. Latent
    attention rotates interleaved pairs, as DeepSeek-V3's checkpoints do: nothing to permute."""
    if args.mla:
        return w
    if name.endswith("wq.weight"):
        return permute(w, args.n_heads)
    if name.endswith("wk.weight"):
        return permute(w, args.n_kv_heads)
    if name.endswith(("q_norm.weight", "k_norm.weight")):  # one head's channels
        return permute(w[:, None], 1)[:, 0]
    return w


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def peft_lora_config(folder: Path, args: ModelArgs, field: str) -> dict[str, Any]:
    """The ``[lora]`` fields (rank, alpha, dropout, targets in our names) of a PEFT LoRA folder for a
    model of ``args``, or one line saying why shardwise's LoRA cannot compute it: another PEFT method,
    rsLoRA or DoRA scaling, trained biases or extra modules, a module this model has no linear for."""
    path = folder / PEFT_CONFIG
    if not path.is_file() or not (folder / PEFT_WEIGHTS).is_file():
        raise ConfigError(f"{field} '{folder}' is not a PEFT adapter folder (it needs {PEFT_CONFIG} and "
                          f"{PEFT_WEIGHTS})")
    try:
        c = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(c, dict) or c.get("peft_type") != "LORA":
        raise ConfigError(f"{field}: {path} is not a LoRA adapter (peft_type "
                          f"{c.get('peft_type') if isinstance(c, dict) else None!r})")
    for key, fine in (("use_rslora", False), ("use_dora", False), ("bias", "none"),
                      ("fan_in_fan_out", False)):
        if c.get(key, fine) != fine:
            raise ConfigError(f"{field}: {path} has {key}={c[key]!r}, which shardwise's LoRA does not "
                              f"compute (only {key}={fine!r})")
    if c.get("modules_to_save"):
        raise ConfigError(f"{field}: {path} also trains whole modules (modules_to_save="
                          f"{c['modules_to_save']}), which shardwise's LoRA does not")
    r, alpha = c.get("r"), c.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"{field}: {path} has no usable r ({r!r}) and lora_alpha ({alpha!r})")
    ours = {hf.rsplit(".", 2)[-2]: name.rsplit(".", 2)[-2] for name, hf in hf_names(args).items()
            if name.startswith("layers.") and name.endswith(".weight")}  # q_proj -> wq, ...
    theirs = c.get("target_modules")
    if isinstance(theirs, str):
        theirs = [theirs]
    if not isinstance(theirs, list) or not theirs:
        raise ConfigError(f"{field}: {path} names target_modules {theirs!r}: shardwise reads a list of "
                          "module names (q_proj, ...)")
    if unknown := [t for t in theirs if t not in ours]:
        raise ConfigError(f"{field}: {path} adapts '{unknown[0]}', which this model has no linear for "
                          f"(its linears: {', '.join(sorted(ours))})")
    return {"rank": r, "alpha": float(alpha), "dropout": float(c.get("lora_dropout") or 0.0),
            "targets": ",".join(sorted({ours[t] for t in theirs}))}
