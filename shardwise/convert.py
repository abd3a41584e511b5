"""Interchange with Hugging Face checkpoints (``config.json`` + safetensors): the Llama family
(``LlamaForCausalLM``), Qwen3 (``Qwen3ForCausalLM``: QK-norm) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

- :func:`args_from_hf`: the model shape from an HF ``config.json`` -- no preset or model flags.
- :func:`hf_config`: the ``config.json`` of the HF class matching a shape.
- :func:`export_hf`: a shardwise checkpoint (any layout; DCP gathers the shards) -> an HF folder that
  ``from_pretrained`` loads, in bf16 or fp32, written one safetensors shard at a time.
- :func:`import_hf`: an HF folder -> a weights-only shardwise checkpoint, to start training from
  with ``--checkpoint.path`` (optimizer, schedule and data start fresh), tensors read one at a time.

Our attention uses Meta's interleaved RoPE pairs; HF's uses rotate-half, so the q/k projection rows
(and the QK-norm weights, which scale the same channels) are permuted on the way out and back on the
way in (an exact permutation: a round trip is lossless). HF stores each expert's three matrices
(``mlp.experts.<e>.{gate,up,down}_proj.weight``, out x in); ours are one (E, in, out) tensor each.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import CheckpointError, load_model_only, read_manifest, save_model_only
from shardwise.config import ConfigError, ModelConfig
from shardwise.models import ModelArgs, build_model, check_args, model_args
from shardwise.models.presets import PRESETS

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SHARD_BYTES = 5 << 30  # split safetensors files at this size, as HF's save_pretrained does
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
_ROUTER = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
_EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
            "feed_forward.experts.w2": "down_proj"}  # ours (E, in, out); HF experts.<e>.<name> (out, in)
_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows: interleaved RoPE pairs (ours) -> rotate-half halves (HF), per head."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def from_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_rotate_half`."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def hf_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> the HF name, for every parameter that maps one to one (an MoE block's
    experts map to one HF tensor per expert: :func:`expert_names`)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        layer = {**_LAYER, **(_QK_NORM if args.qk_norm else {}),
                 **(_ROUTER if args.is_moe_layer(i) else _DENSE_FFN)}
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{hf}" for ours, hf in layer.items()})
    return names


def expert_names(args: ModelArgs) -> dict[str, list[str]]:
    """Our (E, in, out) expert tensor -> its E HF per-expert matrices, in expert order."""
    return {f"layers.{i}.{ours}": [f"model.layers.{i}.mlp.experts.{e}.{hf}.weight"
                                   for e in range(args.n_experts)]
            for i in range(args.n_layers) if args.is_moe_layer(i) for ours, hf in _EXPERTS.items()}


def _rope_rows(name: str, w: torch.Tensor, args: ModelArgs, permute: Callable) -> torch.Tensor:
    """``permute`` (either direction) applied to the q/k projections and QK-norm weights."""
    if name.endswith("wq.weight"):
        return permute(w, args.n_heads)
    if name.endswith("wk.weight"):
        return permute(w, args.n_kv_heads)
    if name.endswith(("q_norm.weight", "k_norm.weight")):  # one head's channels
        return permute(w[:, None], 1)[:, 0]
    return w


def to_hf_tensors(get: Callable[[str], torch.Tensor], args: ModelArgs
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every HF tensor, from ``get`` (our name -> our tensor), one at a time."""
    for ours, hf in hf_names(args).items():
        yield hf, _rope_rows(ours, get(ours), args, to_rotate_half)
    for ours, hf_list in expert_names(args).items():
        w = get(ours)  # (E, in, out)
        for e, hf in enumerate(hf_list):
            yield hf, w[e].t()


def to_hf_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return dict(to_hf_tensors(state.__getitem__, args))


def from_hf_tensors(get: Callable[[str], torch.Tensor], args: ModelArgs
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every parameter, from ``get`` (HF name -> HF tensor), one at a time."""
    for ours, hf in hf_names(args).items():
        yield ours, _rope_rows(ours, get(hf), args, from_rotate_half)
    for ours, hf_list in expert_names(args).items():
        yield ours, torch.stack([get(hf).t() for hf in hf_list])


def from_hf_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    def get(hf: str) -> torch.Tensor:
        if hf not in state:
            raise ConfigError(f"the HF checkpoint has no tensor '{hf}': is it a checkpoint of this "
                              "model config?")
        return state[hf]
    return dict(from_hf_tensors(get, args))


def hf_family(args: ModelArgs) -> str:
    """The HF ``model_type`` a shape exports as (one-line error for a shape none of them has)."""
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


def _rope(hf: dict[str, Any]) -> tuple[dict[str, Any], str, float]:
    """(rope scaling dict, its type, rope theta) of an HF config (transformers 4 and 5 spellings)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    return rope, kind, float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))


def args_from_hf(hf: dict[str, Any]) -> ModelArgs:
    """The model shape of an HF ``config.json`` (Llama, Qwen3, Qwen3-MoE), or a one-line error
    naming what this model family cannot represent."""
    kind = hf.get("model_type")
    if kind not in _CLASSES:
        raise ConfigError(f"HF model_type '{kind}' is not supported: convert reads "
                          f"{', '.join(_CLASSES)} (Llama, Qwen3 and Qwen3-MoE checkpoints)")
    for key, bad in (("hidden_act", hf.get("hidden_act", "silu") != "silu"),
                     ("attention_bias", bool(hf.get("attention_bias"))),
                     ("mlp_bias", bool(hf.get("mlp_bias"))),
                     ("use_sliding_window", bool(hf.get("use_sliding_window")))):
        if bad:
            raise ConfigError(f"HF config {key}={hf.get(key)} is not supported (SwiGLU with silu, no "
                              "biases, full attention)")
    rope, rope_type, theta = _rope(hf)
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"HF config rope type '{rope_type}' is not supported (default and llama3 are)")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
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
        if f.name.startswith("moe_") and not args.n_experts or f.name == "max_seq_len":
            continue  # (a dense model's MoE knobs are inert; any RoPE table length is a choice)
        if f.name in ("multiple_of", "ffn_dim_multiplier", "ffn_hidden_size", "head_size"):
            continue  # compared through what they give: the FFN width and the head width below
        if (math.isclose(a, b) if isinstance(a, float) else a == b):
            continue
        raise ConfigError(f"HF config gives model.{f.name}={a} but the model config has {b}: set "
                          f"--model.{f.name}={a}, or drop --config to take the shape from config.json")
    for what, a, b in (("ffn_hidden_size", theirs.ffn_hidden_dim, args.ffn_hidden_dim),
                       ("head_size", theirs.head_dim, args.head_dim)):
        if a != b:
            raise ConfigError(f"HF config gives model.{what}={a} but the model config gives {b}: set "
                              f"--model.{what}={a}, or drop --config to take the shape from config.json")


def export_hf(checkpoint: Path, out: Path, dtype: str = "bf16") -> list[Path]:
    """Write ``out/config.json`` and safetensors (sharded above 5 GiB) from a shardwise checkpoint,
    converting and writing one shard at a time (the model in fp32 plus one shard in memory)."""
    from safetensors.torch import save_file

    manifest = read_manifest(checkpoint)
    if "model" not in manifest:
        raise CheckpointError(f"checkpoint '{checkpoint}' records no model config in its manifest")
    args = model_args(ModelConfig(**manifest["model"]))
    config = hf_config(args, dtype)
    model = build_model(args)
    model.to_empty(device="cpu")
    load_model_only(checkpoint, model)
    state = model.state_dict()
    if any(k.endswith("router.expert_bias") and v.any() for k, v in state.items()):
        raise ConfigError("this checkpoint's experts are chosen with a routing bias (model.moe_balance="
                          "bias), which HF Qwen3-MoE does not have: its routing would differ")
    itemsize = _DTYPES[dtype].itemsize
    meta = build_model(args).state_dict()
    plan = [(n, t.numel() * itemsize) for n, t in to_hf_tensors(meta.__getitem__, args)]
    shard_of, shards, size = {}, 0, 0
    for name, nbytes in plan:  # sizes from the meta model: file names need the shard count first
        if size and size + nbytes > _SHARD_BYTES:
            shards, size = shards + 1, 0
        shard_of[name], size = shards, size + nbytes
    n = shards + 1
    files = [out / "model.safetensors"] if n == 1 else \
        [out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if n > 1:
        index = {"metadata": {"total_size": sum(b for _, b in plan)},
                 "weight_map": {name: files[i].name for name, i in shard_of.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    current, tensors = 0, {}
    for name, t in to_hf_tensors(state.__getitem__, args):
        if shard_of[name] != current:
            save_file(tensors, str(files[current]), metadata={"format": "pt"})
            current, tensors = shard_of[name], {}
        tensors[name] = t.detach().to(_DTYPES[dtype]).contiguous()
    save_file(tensors, str(files[current]), metadata={"format": "pt"})
    return files


class HFFolder:
    """An HF model folder's ``config.json`` and its safetensors tensors, read one at a time."""

    def __init__(self, folder: Path) -> None:
        from safetensors import SafetensorError, safe_open

        if not (folder / "config.json").is_file():
            raise ConfigError(f"'{folder}' has no config.json: pass an HF model folder")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"'{folder}' has no .safetensors files (only safetensors weights are read)")
        self.config = json.loads((folder / "config.json").read_text())
        self._files, self._where = [], {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ConfigError(f"'{f}' is not a readable safetensors file ({e})") from None
            self._files.append(handle)
            self._where.update({k: handle for k in handle.keys()})  # noqa: SIM118 (a safe_open handle)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConfigError(f"the HF checkpoint has no tensor '{name}': is it a "
                              f"{self.config.get('model_type')} checkpoint of this shape?")
        return self._where[name].get_tensor(name)

    def expert(self, name: str) -> torch.Tensor:
        """A per-expert matrix, also from transformers 5's fused layout (``mlp.experts.gate_up_proj``
        (E, 2h, d) and ``mlp.experts.down_proj`` (E, d, h)) when the folder was saved that way."""
        if name in self._where:
            return self[name]
        prefix, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
        if proj == "down_proj":
            return self[f"{prefix}.down_proj"][e]
        gate_up = self[f"{prefix}.gate_up_proj"][e]  # (2h, d)
        half = gate_up.shape[0] // 2
        return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def read_hf(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, every tensor) of an HF model folder (tests; conversion streams through HFFolder)."""
    f = HFFolder(folder)
    return f.config, {k: f[k] for k in f._where}


def import_hf(folder: Path, out: Path, model_cfg: ModelConfig | None = None) -> tuple[Path, ModelConfig]:
    """Write a weights-only shardwise checkpoint (fp32) at ``out`` from an HF folder. The shape comes
    from its config.json, or from ``model_cfg``, which must agree with it. Returns the checkpoint and
    the ``[model]`` section it records."""
    hf = HFFolder(folder)
    if model_cfg is None:
        args = args_from_hf(hf.config)
        model_cfg = model_config_of(args)
    else:
        args = model_args(model_cfg)
        check_hf_config(hf.config, args)

    def get(name: str) -> torch.Tensor:
        return hf.expert(name) if ".mlp.experts." in name else hf[name]

    expected = build_model(args).state_dict()
    ours = {}
    for name, t in from_hf_tensors(get, args):
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ConfigError(f"HF tensor for '{name}' has shape {tuple(t.shape)}, this model needs "
                              f"{tuple(expected[name].shape)}")
        ours[name] = t.to(torch.float32).contiguous()
    for name in expected:  # buffers saved with the weights (MoE routing bias): no bias
        if name not in ours:
            ours[name] = torch.zeros(expected[name].shape, dtype=expected[name].dtype)
    save_model_only(out, ours, {"model": dataclasses.asdict(model_cfg), "source": str(folder)})
    return out, model_cfg
