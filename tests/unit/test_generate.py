"""Generation: greedy output token for token equal to ``transformers``' ``generate`` on the same
weights (Llama and Qwen3 tiny models made here), the KV cache equal to recomputing the sequence,
sampling's top-k / top-p and seed (also through the command line), the chat prompt as
``transformers`` renders it. (The exported folder's completeness: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.infer import generate as gen
from shardwise.models.presets import PRESETS
from shardwise.models.transformer import KVCache, build_model, init_weights
from tests.helpers import ROOT, require

ASSETS = ROOT / "shardwise" / "data" / "assets"


def _hf_folder(tmp_path: Path, family: str) -> Path:
    """A tiny random HF model saved by transformers, with the shipped tokenizer (vocab 2048)."""
    transformers = require("transformers")
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256, bos_token_id=0,
                  eos_token_id=1)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    folder = tmp_path / family
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / name, folder / name)
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tmp_path: Path, family: str):
    transformers = require("transformers")
    folder = _hf_folder(tmp_path, family)
    loaded = gen.load_for_generation(hf=str(folder), device="cpu", dtype="fp32")
    prompt = gen.prompt_ids(loaded.tokenizer, "In the beginning God created")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert prompt == hf_tok("In the beginning God created")["input_ids"]  # the same special tokens
    ours = gen.generate(loaded.model, prompt, gen.Sampling(max_new_tokens=24), stop=set())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    assert len(set(ours)) > 3  # a real continuation, not one token repeated


def _model(name: str, layers: int = 2):
    args = PRESETS[name]
    import dataclasses

    args = dataclasses.replace(args, n_layers=layers, max_seq_len=128)
    model = build_model(args, device="cpu")
    init_weights(model, 3)
    return model.eval()


@pytest.mark.parametrize("preset", ["debug", "moe-debug", "qwen3-0.6b"])
def test_cache_matches_recomputing_the_sequence(preset: str):
    """Prefill then one token at a time through the cache gives the full forward's logits at every
    position, and the same greedy tokens as recomputing the whole sequence each step."""
    model = _model(preset) if preset != "qwen3-0.6b" else _qwen3_small()
    tokens = torch.randint(0, 2000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)  # (1, 40, V)
        cache = KVCache(40)
        parts = [model(tokens[:, :25], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache)
                                                        for i in range(25, 40)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)
    s = gen.Sampling(max_new_tokens=20)
    prompt = tokens[0, :10].tolist()
    assert gen.generate(model, prompt, s, set()) == gen.generate(model, prompt, s, set(), use_cache=False)


def _qwen3_small():
    import dataclasses

    args = dataclasses.replace(PRESETS["qwen3-0.6b"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_size=32, ffn_hidden_size=96, vocab_size=2048, max_seq_len=128)
    model = build_model(args, device="cpu")
    init_weights(model, 3)
    return model.eval()


def test_sampling_top_k_top_p_and_seed():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])
    greedy = gen.Sampling(temperature=0)
    assert gen.next_token(logits, greedy, None).item() == 1
    g = torch.Generator().manual_seed(0)
    # top-k 1 and a nucleus smaller than the likeliest token's probability leave only it
    for narrow in (gen.Sampling(temperature=1.0, top_k=1), gen.Sampling(temperature=1.0, top_p=0.3)):
        assert {gen.next_token(logits, narrow, g).item() for _ in range(50)} == {1}
    # top-k 2: exactly the two likeliest ever come out, both of them
    seen = {gen.next_token(logits, gen.Sampling(temperature=1.0, top_k=2), g).item() for _ in range(200)}
    assert seen == {1, 2}
    # a nucleus of 0.8: token 1 (p 0.47) alone falls short, with token 2 (0.43) it is reached, so
    # token 4 and the rest are dropped
    probs = logits.softmax(-1)[0]
    assert probs[1] < 0.8 <= probs[1] + probs[2]
    seen = {gen.next_token(logits, gen.Sampling(temperature=1.0, top_p=0.8), g).item() for _ in range(200)}
    assert seen == {1, 2}
    # the same seed, the same sample
    model = _model("debug")
    s = gen.Sampling(max_new_tokens=12, temperature=1.0, top_k=50, seed=7)
    assert gen.generate(model, [5, 6, 7], s, set()) == gen.generate(model, [5, 6, 7], s, set())


def test_chat_prompt_is_rendered_as_transformers_renders_it(tmp_path: Path):
    transformers = require("transformers")
    folder = _hf_folder(tmp_path, "qwen3")
    loaded = gen.load_for_generation(hf=str(folder), device="cpu", dtype="fp32")
    messages = [{"role": "system", "content": "Answer in the words of the King James Bible."},
                {"role": "user", "content": "Who created the heaven and the earth?"}]
    ours = gen.prompt_ids(loaded.tokenizer, messages=messages)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)


def test_generation_config_end_tokens(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert gen.generation_eos(tmp_path) == {7, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert gen.generation_eos(tmp_path) == {3}


def test_context_limit_is_one_line():
    from shardwise.config.schema import ConfigError

    model = _model("debug")
    with pytest.raises(ConfigError, match="exceeds the model's context of 128 tokens"):
        gen.generate(model, list(range(100)), gen.Sampling(max_new_tokens=40), set())


def test_sampling_through_the_command_line_is_seeded(tmp_path: Path, capsys):
    """`generate --temperature --top-p --seed` (in-process): the same seed, the same tokens."""
    from shardwise.cli import main

    folder = _hf_folder(tmp_path, "llama")
    capsys.readouterr()
    runs = []
    for _ in range(2):
        assert main(["generate", "--hf", str(folder), "--prompt", "And God said", "--temperature", "0.8",
                     "--top-p", "0.95", "--seed", "1", "--max-new-tokens", "16", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1] and len(runs[0]) >= 1
