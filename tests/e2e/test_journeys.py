"""The fine-tuning journey as a user runs it: an HF model folder with its own chat template (one
that rewrites history, as Qwen3's does) -> chat fine-tuning started from it with no more flags than
the folder and the data -> export -> the exported folder loads in transformers, whose greedy answer
to a conversation is shardwise generate's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import metrics, require, run_cli
from tests.unit.test_chat import QWEN3, _folder


def test_chat_fine_tuning_from_an_hf_folder_to_a_model_transformers_chats_with(tmp_path: Path,
                                                                            data_cache: str):
    transformers = require("transformers")
    tok_dir = _folder(tmp_path, QWEN3)  # the shipped BPE with ChatML/think special tokens
    hf_cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      vocab_size=2112, max_position_embeddings=256, tie_word_embeddings=True)
    base = tmp_path / "base"
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(base)
    for f in tok_dir.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    chats = tmp_path / "chats.jsonl"
    with chats.open("w") as f:
        for i in range(64):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Who made day {i}?"},
                {"role": "assistant", "content": f"<think>\nGenesis.\n</think>\n\nGod made day {i}."},
                {"role": "user", "content": "And the night?"},
                {"role": "assistant", "content": "<think>\nThe same.\n</think>\n\nHe divided it."}]}) + "\n")
    run_dir = tmp_path / "sft"
    run_cli(["train", f"--checkpoint.initial_hf={base}", "--data.format=chat", f"--data.path={chats}",
             f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}", "--training.steps=6",
             "--training.seq_len=128", "--training.global_batch=4", "--eval.interval=0",
             "--compile.enabled=false", "--metrics.progress=false", "--training.mixed_precision=fp32",
             "--lr_scheduler.warmup_steps=1"])
    rows = metrics(run_dir)
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    hf_out = tmp_path / "exported"
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-6"), "--out", str(hf_out),
             "--dtype", "fp32"])
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
