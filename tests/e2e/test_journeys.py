"""Journeys as a user runs them, through the CLI, each command after the one before:

- pretraining: plan a preset on GPUs -> train the written config (here on 2 CPU ranks) -> a rank is
  lost -> resume from the last checkpoint, on the planned shape and layout throughout;
- fine-tuning: an HF model folder with its own chat template (one that rewrites history, as Qwen3's
  does) -> chat fine-tuning started from it with no more flags than the folder and the data ->
  export -> the exported folder loads in transformers, whose greedy answer to a conversation is
  shardwise generate's;
- a DeepSeek-V3 model: train the debug preset with expert parallel -> generate from the checkpoint
  (latent attention's KV cache gives what recomputing does) -> export -> transformers'
  DeepseekV3ForCausalLM continues the prompt greedily exactly as shardwise does.

(Generation and evaluation: tests/unit/test_generate.py, tests/e2e/test_eval.py; the documented
commands of docs/*.md: tests/e2e/test_docs_commands.py.)"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from shardwise.data.tokenizer import ASSETS
from tests.helpers import QWEN3, TINY_ARGS, fake_hub, hub_cache, metrics, require, run_cli, tiny_qwen3


def test_pretraining_plan_train_lose_a_rank_resume(tmp_path: Path, data_cache: str):
    plan = tmp_path / "plan.toml"
    out = run_cli(["plan", "--model", "debug", "--nproc", "2", "--hardware", "h100",
                   "--out", str(plan)]).stdout
    assert out.startswith("model debug (6.16M params), sequence 512, 8 sequences = 4,096 tokens per step")
    written = tomllib.loads(plan.read_text())
    run_dir = tmp_path / "run"
    # the planned GPUs are 2 CPU ranks here (run.device cpu, the plan's bf16 kept)
    common = ["train", "--config", str(plan), "--run.device", "cpu", "--nproc", "2", f"--run.dir={run_dir}",
              f"--data.cache_dir={data_cache}", "--training.steps=4", "--checkpoint.interval=2",
              "--eval.interval=0", "--metrics.log_format=line"]
    lost = run_cli([*common, "--debug.fail_step=3"], check=False)  # a rank is killed in step 3
    assert lost.returncode != 0 and [r["step"] for r in metrics(run_dir)] == [1, 2]
    run_cli([*common, "--checkpoint.resume=true"])  # (from step 2's checkpoint)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    ran = tomllib.loads((run_dir / "config.toml").read_text())
    assert ran["parallel"] == written["parallel"] and ran["training"]["seq_len"] == 512
    assert ran["training"]["global_batch"] == 8 and ran["training"]["mixed_precision"] == "bf16"


def _conversations(n: int) -> list[dict]:
    return [{"messages": [
        {"role": "user", "content": f"Who made day {i}?"},
        {"role": "assistant", "content": f"<think>\nGenesis.\n</think>\n\nGod made day {i}."},
        {"role": "user", "content": "And the night?"},
        {"role": "assistant", "content": "<think>\nThe same.\n</think>\n\nHe divided it."}]}
        for i in range(n)]


SFT = ["--data.format=chat", "--training.seq_len=128", "--training.global_batch=4", "--eval.interval=0",
       "--compile.enabled=false", "--metrics.log_format=line", "--training.mixed_precision=fp32",
       "--lr_scheduler.warmup_steps=1"]


def test_chat_fine_tuning_from_a_hub_id_to_a_model_transformers_chats_with(tmp_path: Path, data_cache: str):
    transformers = require("transformers")
    # README's fine-tuning command: the Hub id, read from a cache filled beforehand, offline
    home = tmp_path / "hf-home"
    hub_cache(home, "Qwen/Qwen3-0.6B", tiny_qwen3(tmp_path))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in _conversations(64)))
    run_dir = tmp_path / "sft"
    out = run_cli(["train", "--checkpoint.initial_hf", "Qwen/Qwen3-0.6B", "--data.path", str(chats),
                   f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}", "--training.steps=6", *SFT],
                  env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}).stdout
    # The pretraining learning rate is named, with the family's fine-tuning preset; whole
    # conversations are packed and the packing's efficiency is in the run's log.
    assert "notice: checkpoint.initial_hf starts from trained weights, but optimizer.lr=0.001" in out
    assert "--config configs/sft-qwen3.toml" in out
    assert "conversations packed whole into" in out and "packing efficiency" in out
    rows = metrics(run_dir)
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    hf_out = tmp_path / "exported"
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-6"), "--out", str(hf_out),
             "--dtype", "fp32"], env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})  # (its tokenizer)
    tok = transformers.AutoTokenizer.from_pretrained(hf_out)
    assert tok.chat_template == QWEN3  # the run's template travels with the model
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_out)
    conversation = [{"role": "user", "content": "Who made day 7?"}]
    (tmp_path / "ask.json").write_text(json.dumps(conversation))
    prompt = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    ours = json.loads(run_cli(["generate", "--hf", str(hf_out), "--messages", str(tmp_path / "ask.json"),
                               "--max-new-tokens", "10", "--dtype", "fp32", "--json"]).stdout)
    assert ours["prompt_tokens"] == prompt and ours["tokens"] == theirs


def test_a_login_node_downloads_and_a_compute_node_trains_and_generates_offline(tmp_path: Path,
                                                                              data_cache: str):
    pq = require("pyarrow.parquet")
    import pyarrow as pa

    data = tmp_path / "chats-repo" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_conversations(32)), data / "train-00000-of-00001.parquet")
    (data.parent / "README.md").write_text("# a dataset card, not a corpus file")
    home = {"HF_HOME": str(tmp_path / "hf-home")}
    with fake_hub({"org/tiny-qwen3": tiny_qwen3(tmp_path), "datasets/org/chats": data.parent}) as (url, _):
        for ref in ("org/tiny-qwen3", "hf://datasets/org/chats/data"):
            said = run_cli(["download", ref], env={**home, "HF_ENDPOINT": url}).stdout
            assert said.startswith(f"downloaded {ref} (") and str(tmp_path / "hf-home") in said
    offline = {**home, "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "sft"
    run_cli(["train", "--checkpoint.initial_hf=org/tiny-qwen3", "--data.path=hf://datasets/org/chats/data",
             f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}", "--training.steps=2", *SFT],
            env=offline)
    assert len(metrics(run_dir)) == 2
    ran = tomllib.loads((run_dir / "config.toml").read_text())
    assert ran["checkpoint"]["initial_hf"] == ran["data"]["tokenizer"] == "org/tiny-qwen3"
    out = json.loads(run_cli(["generate", "--hf", "org/tiny-qwen3", "--prompt", "In the beginning",
                              "--max-new-tokens", "3", "--json"], env=offline).stdout)
    assert len(out["tokens"]) == 3
    said = run_cli(["convert", "--from-hf", "org/tiny-qwen3", "--out", str(tmp_path / "ckpt")],
                   env=offline).stdout
    assert "imported" in said and (tmp_path / "ckpt.toml").is_file()
    missing = run_cli(["generate", "--hf", "org/other", "--prompt", "x"], env=offline, check=False)
    assert missing.returncode == 2 and "shardwise download org/other" in missing.stderr


@pytest.mark.slow  # (make test-all: make test keeps within its time on 2 cores)
def test_deepseek_train_generate_export_to_transformers(tmp_path: Path, data_cache: str):
    transformers = require("transformers")
    run_dir = tmp_path / "run"
    run_cli(["train", "--config", "configs/deepseek-debug.toml", "--nproc", "2", "--parallel.ep", "2",
             f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}", "--training.steps=4",
             "--training.seq_len=128", "--eval.interval=0", "--checkpoint.interval=0",
             "--lr_scheduler.warmup_steps=1", "--metrics.log_format=line"])
    rows = metrics(run_dir)
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["expert_load"] >= 1.0
    ckpt = run_dir / "checkpoints" / "step-4"
    ask = ["generate", "--checkpoint", str(ckpt), "--prompt", "In the beginning God",
           "--max-new-tokens", "12", "--dtype", "fp32", "--json"]
    ours = json.loads(run_cli(ask).stdout)
    assert json.loads(run_cli([*ask, "--no-cache"]).stdout)["tokens"] == ours["tokens"]
    hf_out = tmp_path / "exported"
    run_cli(["convert", "--to-hf", str(ckpt), "--out", str(hf_out), "--dtype", "fp32"])
    assert json.loads((hf_out / "config.json").read_text())["model_type"] == "deepseek_v3"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    prompt = torch.tensor([ours["prompt_tokens"]])
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert theirs == ours["tokens"]


def test_train_on_two_ranks_resolves_a_hub_id_once_before_the_ranks_start(tmp_path: Path):
    """`train --nproc 2 --data.tokenizer ORG/NAME` with an empty cache: the launcher fetches the
    tokenizer once (each file's bytes sent once), and both ranks read it from the cache."""
    repo = tmp_path / "tok-repo"
    repo.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (repo / name).write_bytes((ASSETS / name).read_bytes())
    run_dir = tmp_path / "run"
    with fake_hub({"org/tok": repo}) as (url, served):
        run_cli(["train", *TINY_ARGS, "--nproc=2", "--training.steps=2", "--data.tokenizer=org/tok",
                 f"--data.cache_dir={tmp_path / 'cache'}", f"--run.dir={run_dir}"],
                env={"HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": url})
    assert sorted(served) == ["tokenizer.json", "tokenizer_config.json"]
    assert len(metrics(run_dir)) == 2
    assert len(json.loads((run_dir / "memory_breakdown.json").read_text())["params_per_rank"]) == 2
    assert tomllib.loads((run_dir / "config.toml").read_text())["data"]["tokenizer"] == "org/tok"
