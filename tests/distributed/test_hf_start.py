"""Training from a Hugging Face folder (checkpoint.initial_hf) on any layout, and writing one at each
save (checkpoint.export_hf)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_ARGS, metrics, require, run_cli

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3 (QK-norm, GQA, head width 32 at dim 64, untied) that transformers made and saved."""
    transformers = require("transformers")
    folder = tmp_path_factory.mktemp("hf") / "qwen3"
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# The model comes from the folder: the tiny-model flags of TINY_ARGS are overridden by it.
START = [a for a in TINY_ARGS if not a.startswith("--model.")] + ["--training.seq_len=64"]


# (the one-rank start is in make test-all; test_cli.py's HF round trip trains one rank from a folder)
@pytest.mark.parametrize("layout", [pytest.param([], marks=pytest.mark.slow),
                                    ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2"],
                                    ["--nproc=2", "--parallel.pp=2", "--training.micro_batch=2",
                                     "--data.document_mask=false"]],
                         ids=["1-rank", "fsdp2_tp2", "pp2"])
def test_every_layout_starts_from_the_folders_weights(layout: list[str], qwen3_folder: Path, tmp_path: Path,
                                                      data_cache: str):
    """Each rank keeps its shards of the folder's tensors: the step-0 checkpoint the run saves exports
    back to exactly the folder's tensors (fp32), whatever the layout."""
    run_dir = tmp_path / "run"
    out = run_cli(["train", *START, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
                   f"--checkpoint.initial_hf={qwen3_folder}", "--checkpoint.save_initial=true",
                   "--training.steps=1", *layout]).stdout
    assert f"loaded the weights of {qwen3_folder}" in out
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-0"), "--out", str(tmp_path / "back"),
             "--dtype", "fp32"])
    want, got = _tensors(qwen3_folder), _tensors(tmp_path / "back")
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t.float()), name


def test_each_save_writes_a_folder_transformers_loads(qwen3_folder: Path, tmp_path: Path, data_cache: str):
    """export_hf with keep_latest_k=1: hf/step-<N> beside each kept checkpoint, loadable as Qwen3; the
    export of a retired checkpoint goes with it."""
    transformers = require("transformers")
    run_dir = tmp_path / "run"
    run_cli(["train", *START, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
             f"--checkpoint.initial_hf={qwen3_folder}", "--checkpoint.export_hf=true",
             "--checkpoint.interval=1", "--checkpoint.keep_latest_k=1", "--training.steps=2",
             "--nproc=2", "--parallel.dp_shard=2"])
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-2"]
    assert json.loads((run_dir / "hf" / "step-2" / "config.json").read_text())["model_type"] == "qwen3"
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf" / "step-2")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert len(metrics(run_dir)) >= 1


def test_a_deepseek_folder_starts_ranks_with_its_weights_and_routing_bias(tmp_path: Path, data_cache: str):
    """A DeepSeek-V3 folder transformers made (latent attention, grouped sigmoid routing, a routing
    bias that is not zero) starts EP x TP ranks: the step-0 checkpoint exports back to exactly the
    folder's tensors, the bias (a buffer of ours, e_score_correction_bias in HF) included."""
    transformers = require("transformers")
    folder = tmp_path / "deepseek"
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, vocab_size=2048,
        max_position_embeddings=128, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            bias.copy_(torch.linspace(-0.05, 0.05, bias.numel()))
    model.save_pretrained(folder)
    run_dir = tmp_path / "run"
    run_cli(["train", *START, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
             f"--checkpoint.initial_hf={folder}", "--checkpoint.save_initial=true", "--training.steps=1",
             "--data.document_mask=false", "--nproc=4", "--parallel.ep=2", "--parallel.tp=2"])
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-0"), "--out", str(tmp_path / "back"),
             "--dtype", "fp32"])
    from shardwise.checkpoint.hf import HFFolder
    from shardwise.models.hf_config import args_from_hf, expert_names, hf_names

    want, got = HFFolder(folder), _tensors(tmp_path / "back")  # (HFFolder reads either expert layout)
    args = args_from_hf(want.config)
    assert set(got) == {*hf_names(args).values(), *(n for ns in expert_names(args).values() for n in ns)}
    assert any(k.endswith("e_score_correction_bias") for k in got)
    for name, t in got.items():
        assert torch.equal(t, want[name].float()), name
