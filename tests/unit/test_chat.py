"""Chat data: conversations rendered by the tokenizer's chat template, the loss on assistant tokens
only -- against transformers' own rendering, through preparation and the loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.config import Config, ConfigError
from shardwise.data.dataset import IGNORE_INDEX, PackedLoader, open_corpus
from shardwise.data.indexed import Shard
from shardwise.data.sources import DataError
from shardwise.data.tokenizer import ASSETS, HFTokenizer, load_tokenizer
from tests.conftest import require

CHAT = [{"role": "system", "content": "Answer from the King James Bible."},
        {"role": "user", "content": "Quote Genesis 1:1."},
        {"role": "assistant", "content": "In the beginning God created the heaven and the earth."},
        {"role": "user", "content": "And the next verse?"},
        {"role": "assistant", "content": "And the earth was without form, and void."}]


def test_rendering_matches_transformers():
    """The shipped tokenizer folder's template renders (with and without the generation prompt) and
    tokenizes exactly as transformers' apply_chat_template does."""
    transformers = require("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(ASSETS))
    ours = load_tokenizer("")
    for msgs, prompt in ((CHAT, False), (CHAT[:4], True)):
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        assert ours.chat.render(msgs, add_generation_prompt=prompt) == text
    ids, _ = ours.encode_chats([CHAT])[0]
    assert ids == hf(hf.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]


def test_the_mask_is_each_assistant_turn_and_its_end_of_turn():
    tok = load_tokenizer("")
    ids, mask = tok.encode_chats([CHAT])[0]
    assert len(ids) == len(mask)
    kept = tok._tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert kept == ("In the beginning God created the heaven and the earth.<|eos|>"
                    "And the earth was without form, and void.<|eos|>")


def test_a_template_that_rewrites_history_is_refused(tmp_path: Path):
    """A template that drops earlier assistant turns: their tokens cannot be found. One line."""
    (tmp_path / "tokenizer.json").write_bytes((ASSETS / "tokenizer.json").read_bytes())
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                               "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="renders an earlier turn differently"):
        load_tokenizer(str(tmp_path)).encode_chats([CHAT])


def test_a_tokenizer_folder_gives_its_special_tokens(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_bytes((ASSETS / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|pad|>"}, "eos_token": "<|bos|>", "pad_token": "<|eos|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.chat) == (2, 0, 1, None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ConfigError, match="names eos_token '<|nope|>', which"):
        HFTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        load_tokenizer("byte").encode_chats([CHAT])


def _chat_cfg(tmp_path: Path, **data) -> Config:
    cfg = Config()
    cfg.data.format, cfg.data.document_mask, cfg.data.cache_dir = "chat", True, str(tmp_path / "cache")
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_windows_count_exactly_the_assistant_tokens(tmp_path: Path):
    """The shipped chat set, prepared: in every window a label counts iff it is an assistant token of
    the same conversation as its input; over all windows that is every assistant token the windows
    reach (the loss mask shard, summed)."""
    cfg = _chat_cfg(tmp_path)
    corpus = open_corpus(cfg.data, load_tokenizer(""))
    (stream,) = corpus.train
    seq = 256
    n = stream.num_windows(seq)
    masks = np.concatenate([m.tokens for m in stream.masks])
    tokens = np.concatenate([s.tokens for s in stream.shards])
    counted = 0
    for i in range(n):
        inputs, labels, _ = stream.window(i, seq)
        np.testing.assert_array_equal(inputs, tokens[i * seq:(i + 1) * seq])
        valid = labels != IGNORE_INDEX
        assert (valid <= masks[i * seq + 1:(i + 1) * seq + 1].astype(bool)).all()  # never a prompt token
        counted += int(valid.sum())
    # Each assistant token the windows reach is a label once (an assistant token never opens a
    # conversation, so no document boundary takes one away).
    assert counted == int(masks[1:n * seq + 1].sum())
    loader = PackedLoader(corpus.train, seq, 8, 8, 0, 1, seed=0, document_mask=True)
    (batch,) = loader.next_step()
    assert batch.n_valid == int((batch.labels != IGNORE_INDEX).sum()) > 0
    assert batch.doc_ids is not None


def test_bad_chat_rows_are_named_by_file_and_row(tmp_path: Path):
    bad = tmp_path / "chats.jsonl"
    bad.write_text(json.dumps({"messages": CHAT}) + "\n" +
                   json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match=r"chats.jsonl' row 2: 'messages' is no assistant message"):
        open_corpus(_chat_cfg(tmp_path, path=str(bad)).data, load_tokenizer(""))
    text = tmp_path / "plain.txt"
    text.write_text("In the beginning.\n")
    with pytest.raises(ConfigError, match="data.format=chat reads conversations from .jsonl/.json/.parquet"):
        open_corpus(_chat_cfg(tmp_path, path=str(text)).data, load_tokenizer(""))


def test_the_shipped_chat_set_prepares_with_masks(tmp_path: Path):
    open_corpus(_chat_cfg(tmp_path).data, load_tokenizer(""))
    (where,) = (tmp_path / "cache" / "prepared").iterdir()
    manifest = json.loads((where / "manifest.json").read_text())
    assert manifest["data_format"] == "chat" and manifest["docs"] > 3000
    assert 0 < manifest["assistant_tokens"] < manifest["tokens"]
    assert Shard(where / "shards" / "00000.train.mask").n_tokens == manifest["tokens"]
