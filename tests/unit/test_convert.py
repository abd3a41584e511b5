"""HF interchange: export loads in transformers with the same logits; import -> export is lossless."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint, convert
from shardwise.config import ConfigError, ModelConfig
from shardwise.models import build_model, init_weights, model_args
from tests.conftest import require

MODEL = ModelConfig(name="debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                    multiple_of=16, max_seq_len=64)


def saved_model(tmp_path: Path, cfg: ModelConfig = MODEL, seed: int = 1) -> tuple[Path, torch.nn.Module]:
    from shardwise.config import Config
    from shardwise.config_checks import resolve_model

    full = Config(model=dataclasses.replace(cfg))
    resolve_model(full)
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


@pytest.mark.parametrize("tie,scaling", [(False, 1.0), (True, 8.0)])
def test_export_loads_in_transformers_with_equal_logits(tmp_path: Path, tie: bool, scaling: float):
    transformers = require("transformers")
    cfg = dataclasses.replace(MODEL, tie_embeddings=tie, rope_scaling_factor=scaling)
    path, ours = saved_model(tmp_path, cfg)
    checkpoint.verify(path)
    out = tmp_path / "hf"
    convert.export_hf(path, out, dtype="fp32")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=2e-5, rtol=2e-5)


def test_hf_round_trip_is_lossless(tmp_path: Path):
    path, ours = saved_model(tmp_path)
    convert.export_hf(path, tmp_path / "hf", dtype="fp32")
    back = convert.import_hf(tmp_path / "hf", tmp_path / "back", MODEL)
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


def test_import_checks_the_hf_config_against_the_model(tmp_path: Path):
    path, _ = saved_model(tmp_path)
    convert.export_hf(path, tmp_path / "hf", dtype="fp32")
    with pytest.raises(ConfigError, match="HF config hidden_size=64 but model.dim gives 128"):
        convert.import_hf(tmp_path / "hf", tmp_path / "x", dataclasses.replace(MODEL, dim=128))
    with pytest.raises(ConfigError, match="has no config.json"):
        convert.import_hf(tmp_path, tmp_path / "x", MODEL)
