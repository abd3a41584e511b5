"""LoRA through the commands, as a user runs it: a full run's checkpoint as the base, a LoRA run that
keeps every base weight and trains the adapters, its resume bit for bit, its export merged and
loaded by transformers, its scores; and its FSDP and HSDP layouts against one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_ARGS, metrics, require, run_cli


def test_lora_from_a_base_keeps_it_resumes_exactly_and_exports_merged(tmp_path: Path, data_cache: str):
    transformers = require("transformers")
    from shardwise.checkpoint import read_model_tensors

    common = [*TINY_ARGS, f"--data.cache_dir={data_cache}"]
    base = tmp_path / "base"
    run_cli(["train", *common, "--training.steps=2", "--checkpoint.final=true", f"--run.dir={base}"])
    lora = [*common, "--lora.rank=4", "--lora.alpha=8", "--training.steps=4", "--checkpoint.interval=2",
            "--checkpoint.final=true", "--optimizer.lr=1e-2"]
    start = f"--checkpoint.path={base / 'checkpoints' / 'step-2'}"
    a = tmp_path / "a"
    # (as a GPU preset sets them: float8 and compile adapt to LoRA, each said)
    out = run_cli(["train", *lora, start, "--float8.enabled=true", "--compile.enabled=true",
                   f"--run.dir={a}"]).stdout
    assert "LoRA r=4 alpha=8 on all-linear, the rest frozen" in out
    assert "notice: lora: float8 linears take no adapter yet: this run trains without float8" in out
    assert "notice: compile.enabled=true: eager, LoRA runs eager so far" in out
    # every base tensor of the LoRA run's last checkpoint is the base run's, as loaded
    got = read_model_tensors(a / "checkpoints" / "step-4")
    was = read_model_tensors(base / "checkpoints" / "step-2")
    adapters = sorted(set(got) - set(was))
    assert len(adapters) == 2 * 7 * 2 and all(n.endswith(("lora_a", "lora_b")) for n in adapters)
    assert all(torch.equal(got[n], was[n]) for n in was)
    assert all(got[n].abs().sum() > 0 for n in adapters if n.endswith("lora_b"))  # (from zero)
    manifest = json.loads((a / "checkpoints" / "step-4" / "manifest.json").read_text())
    assert manifest["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": "all-linear"}
    # stopped after step 2 and resumed: steps 3 and 4 as the run that went through, bit for bit
    b = tmp_path / "b"
    run_cli(["train", *lora, start, "--training.stop_after=2", f"--run.dir={b}"])
    run_cli(["train", *lora, "--checkpoint.resume=true", f"--run.dir={b}"])
    assert [r["loss"] for r in metrics(b)] == [r["loss"] for r in metrics(a)]
    assert len(metrics(a)) == 4
    # a different [lora] cannot resume it
    proc = run_cli(["train", *lora, "--lora.alpha=16", "--checkpoint.resume=true", f"--run.dir={b}"],
                   check=False)
    assert proc.returncode == 2
    assert "was trained with lora.alpha=8.0, this run has lora.alpha=16.0" in proc.stderr
    # exported merged: transformers' Llama computes what shardwise's LoRA model computes
    run_cli(["convert", "--to-hf", str(a), "--out", str(tmp_path / "hf"), "--dtype", "fp32"])
    import shardwise

    ours = shardwise.load(a).module
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        want, theirs = ours(tokens), hf(tokens).logits
    assert (want - theirs).abs().max() <= 1e-4 * want.abs().max()
    # the adapters alone, as a PEFT folder: PEFT puts them on transformers' base model, the same logits
    peft = require("peft")
    run_cli(["convert", "--to-hf", str(base), "--out", str(tmp_path / "base-hf"), "--dtype", "fp32"])
    out = run_cli(["convert", "--to-hf", str(a), "--out", str(tmp_path / "adapter"), "--adapter", "--dtype",
                   "fp32"]).stdout
    assert "(its LoRA adapters as a PEFT folder, fp32)" in out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                               "down_proj", "up_proj"])
    on_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(on_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = adapted(tokens).logits
    assert (want - theirs).abs().max() <= 1e-4 * want.abs().max()
    # the PEFT folder on the HF base, by shardwise: generate --hf --adapter answers as the LoRA run does
    prompt = ["--prompt", "In the beginning", "--max-new-tokens", "8", "--json"]
    on_hf = json.loads(run_cli(["generate", "--hf", str(tmp_path / "base-hf"), "--adapter",
                                str(tmp_path / "adapter"), *prompt]).stdout)
    own = json.loads(run_cli(["generate", "--checkpoint", str(a), *prompt]).stdout)
    assert on_hf["tokens"] == own["tokens"]
    # and a run starts from it (checkpoint.initial_adapter, on the HF base): its step 0 holds those adapters
    c = tmp_path / "c"
    out = run_cli(["train", *common, f"--checkpoint.initial_hf={tmp_path / 'base-hf'}",
                   f"--checkpoint.initial_adapter={tmp_path / 'adapter'}", "--training.steps=1",
                   "--checkpoint.save_initial=true", "--optimizer.lr=1e-2", f"--run.dir={c}"]).stdout
    assert "checkpoint.initial_adapter: LoRA r=4 alpha=8 on w1,w2,w3,wk,wo,wq,wv" in out
    start = read_model_tensors(c / "checkpoints" / "step-0")
    assert sorted(start) == sorted(got) and all(torch.equal(start[n], got[n]) for n in got)
    base_model = shardwise.load(base).module
    with torch.no_grad():
        assert (base_model(tokens) - want).abs().max() > 1e-3  # (the adapters changed the model)
    # and it is scored as it trained: eval reads the adapters from the checkpoint's manifest
    scores = json.loads(run_cli(["eval", "--checkpoint", str(a), "--json"]).stdout.splitlines()[-1])
    assert scores["scores"][-1]["loss"] > 0


_FLAGS = [*TINY_ARGS[2:], "--lora.rank=4", "--optimizer.lr=1e-2", "--steps", "4"]
_MOE = ["--config", str(Path(TINY_ARGS[1]).with_name("moe-debug.toml")), "--training.seq_len=64",
        "--training.global_batch=8", "--training.mixed_precision=fp32", "--eval.interval=0",
        "--compile.enabled=false", "--lora.rank=4", "--optimizer.lr=1e-2", "--steps", "4"]


def _verify(flags: list[str], ranks: list[str], layouts: list[str], out: Path) -> str:
    """``verify`` of ``layouts``; asserts each is in its table and passes; its output."""
    text = run_cli(["verify", *flags, *ranks, "--layouts", *layouts, "--out", str(out)]).stdout
    rows = [line for line in text.splitlines() if line.startswith(tuple(f"| {x}" for x in layouts))]
    assert len(rows) == len(layouts) and all(r.endswith("| PASS |") for r in rows), text
    return text


def test_lora_under_fsdp_tp_and_ep_matches_one_rank(tmp_path: Path, data_cache: str):
    """``verify`` with ``[lora]`` on, each layout within the fp32 bounds of the one-rank LoRA run:
    FSDP and TP (its adapters split with their base: LoRAColwise / LoRARowwise) on 2 real ranks; the
    MoE preset's EP x TP x FSDP on 4 simulated ranks, its routed experts frozen (they trained under
    EP before its re-wrap kept requires_grad) and said so."""
    cache = f"--data.cache_dir={data_cache}"
    tiny = ["--config", TINY_ARGS[1], *_FLAGS, cache]
    _verify(tiny, ["--nproc", "2"], ["dp_shard=2", "tp=2"], tmp_path / "r")
    _verify([*_MOE, cache], ["--ranks", "4"], ["tp=2,ep=2,dp_shard=2"], tmp_path / "m")
    said = (tmp_path / "m" / "reference.log").read_text()
    assert "lora: the routed experts stay frozen (they take no adapter yet): adapting w1, w2, w3, wk" in said


@pytest.mark.slow
def test_lora_under_the_other_layouts_matches_one_rank(tmp_path: Path, data_cache: str):
    """The rest of the matrix (``make test-all``): CP and PP on 2 real ranks; HSDP, TP x FSDP and
    PP x TP on 4 simulated ranks; the MoE preset's EP x FSDP."""
    cache = f"--data.cache_dir={data_cache}"
    _verify(["--config", TINY_ARGS[1], *_FLAGS, cache], ["--nproc", "2"], ["cp=2", "pp=2"], tmp_path / "r")
    _verify(["--config", TINY_ARGS[1], *_FLAGS, cache], ["--ranks", "4"],
            ["dp_replicate=2,dp_shard=2", "tp=2,dp_shard=2", "pp=2,tp=2"], tmp_path / "s")
    _verify([*_MOE, cache], ["--ranks", "4"], ["ep=2,dp_shard=4"], tmp_path / "m")
