"""HF interchange: export loads in transformers with the same logits; import -> export is lossless."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint
from shardwise.checkpoint import hf as convert
from shardwise.config.schema import ConfigError, ModelConfig
from shardwise.models import model_args
from shardwise.models.transformer import build_model, init_weights
from tests.helpers import require

MODEL = ModelConfig(name="debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                    multiple_of=16, max_seq_len=64)


def saved_model(tmp_path: Path, cfg: ModelConfig = MODEL, seed: int = 1) -> tuple[Path, torch.nn.Module]:
    from shardwise.config.schema import Config
    from shardwise.resolve.checks import complete_model

    full = Config(model=dataclasses.replace(cfg))
    complete_model(full)
    model = build_model(model_args(full.model), device="cpu")
    init_weights(model, seed)
    path = tmp_path / "step-0"
    checkpoint.save_model_only(path, {k: v.detach() for k, v in model.state_dict().items()},
                               {"model": dataclasses.asdict(full.model)})
    return path, model


def test_rope_permutation_round_trips():
    w = torch.randn(4 * 16, 24)
    assert torch.equal(convert.from_rotate_half(convert.to_rotate_half(w, 4), 4), w)
    assert not torch.equal(convert.to_rotate_half(w, 4), w)


# Each family the converter speaks: Llama (GQA; tied with Llama-3.1 RoPE scaling), Qwen3 (QK-norm,
# head width decoupled from dim, an FFN width Llama's rule cannot give), Qwen3-MoE (a dense first
# block, then experts), DeepSeek-V3 (latent attention with low-rank or full queries, YaRN, shared
# experts, sigmoid routing limited to groups, a dense first block).
DEEPSEEK = dataclasses.replace(
    MODEL, name="", n_kv_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
    v_head_dim=10, n_experts=8, moe_top_k=3, moe_hidden_dim=16, n_shared_experts=2, n_dense_layers=1,
    ffn_hidden_size=48, moe_score="sigmoid", moe_route_scale=2.5, moe_n_groups=4, moe_topk_groups=2,
    moe_balance="bias", rope_theta=10000.0, rope_scaling="yarn", rope_scaling_factor=4.0,
    rope_original_max_seq_len=16, rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=0.7, norm_eps=1e-6)
FAMILIES = {
    "llama-gqa": MODEL,
    "llama-tied-scaled": dataclasses.replace(MODEL, tie_embeddings=True, rope_scaling_factor=8.0),
    "qwen3": dataclasses.replace(MODEL, qk_norm=True, head_size=32, ffn_hidden_size=96,
                                 rope_theta=1000000.0, norm_eps=1e-6),
    "qwen3-tied": dataclasses.replace(MODEL, qk_norm=True, tie_embeddings=True, ffn_hidden_size=80),
    "qwen3-moe": dataclasses.replace(MODEL, name="moe-debug", qk_norm=True, head_size=8, n_experts=4,
                                     moe_top_k=2, moe_hidden_dim=32, n_shared_experts=0,
                                     n_dense_layers=1, ffn_hidden_size=48),
    "deepseek-v3": DEEPSEEK,
    "deepseek-v3-full-q": dataclasses.replace(DEEPSEEK, q_lora_rank=0, rope_scaling_factor=1.0,
                                              moe_n_groups=1, moe_topk_groups=1, moe_route_norm=False),
}
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}


def assert_same_logits(ours: torch.nn.Module, hf: torch.nn.Module, vocab: int = 256) -> None:
    """fp32 logits within 1e-4 of the largest logit's magnitude, on random tokens."""
    tokens = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), hf(tokens).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_equal_logits(tmp_path: Path, family: str):
    transformers = require("transformers")
    path, ours = saved_model(tmp_path, FAMILIES[family])
    checkpoint.verify(path)
    out = tmp_path / "hf"
    convert.export_hf(path, out, dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert config["architectures"] == [HF_CLASS[config["model_type"]]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == HF_CLASS[config["model_type"]]
    assert_same_logits(ours.eval(), hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_of_a_transformers_model_needs_no_model_config(tmp_path: Path, family: str):
    """A model transformers made and saved itself (its own init, its own file layout) imports with
    the shape read from config.json alone and computes the same logits."""
    transformers = require("transformers")
    args = model_args(_resolved(FAMILIES[family]))
    config_cls = getattr(transformers, HF_CLASS[convert.hf_family(args)].replace("ForCausalLM", "Config"))
    hf_cfg = convert.hf_config(args, "fp32")
    torch.manual_seed(0)
    # (a deep copy: transformers 5 writes rope_theta into the rope_scaling dict it is given)
    hf = getattr(transformers, HF_CLASS[convert.hf_family(args)])(config_cls(**copy.deepcopy(hf_cfg))).eval()
    for name, bias in hf.named_buffers():  # DeepSeek-V3's routing bias travels with the weights
        if name.endswith("e_score_correction_bias"):
            bias.copy_(torch.rand(bias.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    hf.save_pretrained(tmp_path / "made-by-hf")
    out, model_cfg = convert.import_hf(tmp_path / "made-by-hf", tmp_path / "imported")
    assert convert.hf_config(model_args(model_cfg), "fp32") == hf_cfg  # the same shape
    ours = build_model(model_args(model_cfg))
    ours.to_empty(device="cpu")
    init_weights(ours, 0)  # (every weight is then loaded: the RoPE table is what init builds)
    checkpoint.load_model_only(out, ours)
    assert_same_logits(ours.eval(), hf)


def _resolved(cfg: ModelConfig) -> ModelConfig:
    from shardwise.config.schema import Config
    from shardwise.resolve.checks import complete_model

    full = Config(model=dataclasses.replace(cfg))
    complete_model(full)
    return full.model


def test_hf_round_trip_is_lossless(tmp_path: Path):
    path, ours = saved_model(tmp_path)
    convert.export_hf(path, tmp_path / "hf", dtype="fp32")
    back, _ = convert.import_hf(tmp_path / "hf", tmp_path / "back", MODEL)
    checkpoint.verify(back)
    assert checkpoint.model_only(back)
    again = build_model(model_args(MODEL))
    again.to_empty(device="cpu")
    checkpoint.load_model_only(back, again)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    # bf16 export: exactly the bf16 rounding of each weight.
    convert.export_hf(back, tmp_path / "hf16", dtype="bf16")
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf16" / "model.safetensors"))
    want = convert.to_hf_state({k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()},
                               model_args(MODEL))
    assert exported.keys() == want.keys()
    for name, t in exported.items():  # every tensor: the bf16 rounding of ours (q/k rows permuted)
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name]), name


def test_import_against_a_model_config_ignores_its_training_choices(tmp_path: Path):
    """How MoE routing is balanced and the RoPE table's length are training choices: a config that
    makes other ones still names the HF model's shape."""
    cfg = FAMILIES["qwen3-moe"]
    path, _ = saved_model(tmp_path, cfg)
    convert.export_hf(path, tmp_path / "hf", dtype="fp32")
    mine = dataclasses.replace(cfg, moe_balance="bias", moe_aux_coef=0.5, moe_bias_rate=0.1, max_seq_len=32)
    _, model = convert.import_hf(tmp_path / "hf", tmp_path / "back", mine)
    assert model.moe_balance == "bias" and model.max_seq_len == 32
    with pytest.raises(ConfigError, match="HF config gives model.moe_top_k=2 but the model config has 3"):
        convert.import_hf(tmp_path / "hf", tmp_path / "x", dataclasses.replace(cfg, moe_top_k=3))


def test_import_checks_the_hf_config_against_the_model(tmp_path: Path):
    path, _ = saved_model(tmp_path)
    convert.export_hf(path, tmp_path / "hf", dtype="fp32")
    with pytest.raises(ConfigError, match=r"HF config gives model.dim=64 but the model config has 128"):
        convert.import_hf(tmp_path / "hf", tmp_path / "x", dataclasses.replace(MODEL, dim=128))
    with pytest.raises(ConfigError, match="has no config.json"):
        convert.import_hf(tmp_path, tmp_path / "x", MODEL)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "mlp_only_layers": [1]}, r"dense blocks other than the first \(mlp_only_layers=\[1\]"),
])
def test_unsupported_hf_configs_get_one_line_errors(change: dict, message: str):
    config = {**convert.hf_config(model_args(_resolved(MODEL)), "fp32"), **change}
    with pytest.raises(ConfigError, match=message):
        convert.args_from_hf(config)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": None}, "field 'hidden_size' is missing: a llama config.json gives it as a positive"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' is 0: a llama config.json"),
    ({"vocab_size": "2048"}, "field 'vocab_size' is '2048'"),
    ({"num_hidden_layers": True}, "field 'num_hidden_layers' is True"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "has no 'factor', which a llama config.json gives"),
    ({"rope_scaling": "linear"}, "a value of the wrong kind for a llama model"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8},
     "has no 'num_experts_per_tok', which a qwen3_moe config.json gives"),
])
def test_malformed_hf_configs_are_one_line_errors(change: dict, message: str):
    """A config.json with a size missing, zero or of the wrong type, or a field its family needs
    left out, is one line naming the field -- not a KeyError or ZeroDivisionError traceback."""
    config = {**convert.hf_config(model_args(_resolved(MODEL)), "fp32"), **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as e:
        convert.args_from_hf(config)
    assert "\n" not in str(e.value)


def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path: Path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json' holds a JSON list, not an object of model settings"):
        convert.read_hf_config(tmp_path)


def test_shapes_that_have_no_hf_family_are_refused_on_export():
    moe = model_args(_resolved(dataclasses.replace(MODEL, name="moe-debug")))  # no QK-norm, a shared expert
    with pytest.raises(ConfigError, match="covers the Qwen3-MoE layout.*model.qk_norm=false"):
        convert.hf_config(moe, "fp32")
    with pytest.raises(ConfigError, match="model.n_shared_experts=1"):
        convert.hf_config(dataclasses.replace(moe, qk_norm=True), "fp32")


def test_import_reads_each_family_back_to_the_same_shape():
    """config.json -> ModelArgs -> config.json is the identity on every family here."""
    for cfg in FAMILIES.values():
        args = model_args(_resolved(cfg))
        config = convert.hf_config(args, "bf16")
        assert convert.hf_config(convert.args_from_hf(config), "bf16") == config


def test_fused_expert_layout_imports_like_the_per_expert_one(tmp_path: Path):
    """transformers 5's in-memory layout, if a folder holds it (mlp.experts.gate_up_proj (E, 2h, d),
    mlp.experts.down_proj (E, d, h)), imports to the same weights as the per-expert Hub layout."""
    from safetensors.torch import load_file, save_file

    path, _ = saved_model(tmp_path, FAMILIES["qwen3-moe"])
    convert.export_hf(path, tmp_path / "hub", dtype="fp32")
    state = load_file(str(tmp_path / "hub" / "model.safetensors"))
    fused = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    prefix, n = "model.layers.1.mlp.experts", 4
    fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([state[f"{prefix}.{e}.gate_proj.weight"],
                                                              state[f"{prefix}.{e}.up_proj.weight"]])
                                                   for e in range(n)])
    fused[f"{prefix}.down_proj"] = torch.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    loaded = []
    for folder in ("hub", "fused"):
        out, cfg = convert.import_hf(tmp_path / folder, tmp_path / f"ckpt-{folder}")
        model = build_model(model_args(cfg))
        model.to_empty(device="cpu")
        checkpoint.load_model_only(out, model)
        loaded.append(model.state_dict())
    for k, v in loaded[0].items():
        assert torch.equal(loaded[1][k], v), k


def _hf_deepseek(tmp_path: Path) -> Path:
    """A tiny DeepSeek-V3 that transformers makes and saves itself (fp32)."""
    transformers = require("transformers")
    args = model_args(_resolved(DEEPSEEK))
    hf_cfg = convert.hf_config(args, "fp32")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**copy.deepcopy(hf_cfg))).eval()
    hf.save_pretrained(tmp_path / "fp32")
    return tmp_path / "fp32"


def _quantized_like_deepseek(src: Path, out: Path, block: list[int]
                             ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``src``'s linear weights as float8_e4m3fn with one fp32 ``weight_scale_inv`` per block (the
    amax of the block over 448, as DeepSeek-V3's release has them), embeddings, head, norms and
    router left as they are; returns each quantized weight with its scales."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    out.mkdir()
    quantized = {}
    br, bc = block
    for name in list(tensors):
        w = tensors[name]
        if w.dim() != 2 or any(k in name for k in ("norm", "embed_tokens", "lm_head", "mlp.gate.weight")):
            continue
        rows, cols = w.shape
        scale = torch.empty(-(-rows // br), -(-cols // bc))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
                q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
        tensors[name], tensors[f"{name}_scale_inv"] = q, scale
        quantized[name] = (q, scale)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": block}
    (out / "config.json").write_text(json.dumps(config))
    return quantized


def test_block_fp8_folder_imports_as_its_dequantized_weights(tmp_path: Path):
    """A block-quantized fp8 DeepSeek-V3 folder (blocks of 16 x 16 on a dim-64 model, so edge tiles
    are partial, as 576-wide projections are under 128 x 128) imports with the logits transformers
    computes from the same weights dequantized here by hand; without its scales it would not."""
    transformers = require("transformers")
    from safetensors.torch import load_file, save_file

    fp8 = tmp_path / "fp8"
    quantized = _quantized_like_deepseek(_hf_deepseek(tmp_path), fp8, [16, 16])
    assert any(q.shape[0] % 16 for q, _ in quantized.values())  # partial edge tiles are exercised
    by_hand = tmp_path / "by-hand"
    by_hand.mkdir()
    tensors = {k: v for k, v in load_file(str(fp8 / "model.safetensors")).items()
               if not k.endswith("_scale_inv")}
    for name, (q, scale) in quantized.items():
        w = q.float()
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                w[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16] *= scale[i, j]
        tensors[name] = w
    save_file(tensors, str(by_hand / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (by_hand / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(by_hand), torch_dtype=torch.float32).eval()

    out, model_cfg = convert.import_hf(fp8, tmp_path / "imported")
    ours = build_model(model_args(model_cfg))
    ours.to_empty(device="cpu")
    init_weights(ours, 0)
    checkpoint.load_model_only(out, ours)
    assert_same_logits(ours.eval(), hf)
    # The scales matter: the fp8 values alone are another model.
    folder = convert.HFFolder(fp8)
    name = next(iter(quantized))
    assert not torch.allclose(folder[name], quantized[name][0].float())


@pytest.mark.parametrize("quantization,message", [
    ({"quant_method": "gptq", "bits": 4}, "quantization_config quant_method='gptq': only block-scaled fp8"),
    ({"quant_method": "fp8"}, "quantization_config quant_method='fp8': only block-scaled fp8"),
    ("fp8", "quantization_config 'fp8': only block-scaled fp8"),
])
def test_other_quantizations_are_refused_in_one_line(tmp_path: Path, quantization, message: str):
    src = _hf_deepseek(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as e:
        convert.import_hf(src, tmp_path / "imported")
    assert "\n" not in str(e.value)


def test_fp8_weights_without_their_scales_are_refused(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    fp8 = tmp_path / "fp8"
    quantized = _quantized_like_deepseek(_hf_deepseek(tmp_path), fp8, [16, 16])
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = next(iter(quantized))
    del tensors[f"{name}_scale_inv"]
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"HF tensor '{name}' is float8_e4m3fn but the folder has no"):
        convert.import_hf(fp8, tmp_path / "imported")


def test_a_model_larger_than_memory_is_refused_before_any_read(tmp_path: Path, monkeypatch):
    """convert --from-hf holds the whole fp32 model: one larger than the memory left is refused in one
    line naming --checkpoint.initial_hf, which streams, and nothing is written."""
    src = _hf_deepseek(tmp_path)
    monkeypatch.setattr(convert, "available_memory", lambda: 1 << 10)  # 1 KiB left
    with pytest.raises(ConfigError, match=r"GiB of fp32 weights in memory, and this machine has 0\.0 GiB "
                       r"available: start training from the folder with --checkpoint.initial_hf") as e:
        convert.import_hf(src, tmp_path / "imported")
    assert "\n" not in str(e.value) and not (tmp_path / "imported").exists()
