"""Chat data: conversations rendered by the tokenizer's chat template, the loss on assistant tokens
only -- against transformers' own rendering, through preparation and the loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.config.schema import Config, ConfigError
from shardwise.data.dataset import IGNORE_INDEX, PackedLoader, open_corpus
from shardwise.data.indexed import Shard
from shardwise.data.sources import DataError
from shardwise.data.tokenizer import ASSETS, HFTokenizer, load_tokenizer
from tests.helpers import QWEN3, chat_folder, require

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


def test_a_template_that_drops_history_is_refused(tmp_path: Path):
    """A template that leaves earlier assistant turns out: their tokens cannot be trained. One line."""
    (tmp_path / "tokenizer.json").write_bytes((ASSETS / "tokenizer.json").read_bytes())
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                               "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="leaves assistant turn 3 of 5 messages out of the rendered"):
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


# Templates written here to reproduce what the families' own do (not copies of theirs). Each one's
# expected loss text is written out by hand from the conversation: what each assistant turn renders
# as in the whole conversation, and the token that closes it.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ m['content'] }}"
          "<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING = [*CHAT[:2], {"role": "assistant",
                        "content": "<think>\nGenesis opens so.\n</think>\n\n" + CHAT[2]["content"]},
            CHAT[3], {"role": "assistant",
                      "content": "<think>\nVerse two.\n</think>\n\n" + CHAT[4]["content"]}]
EXPECTED = {
    "chatml": (CHAT, CHAT[2]["content"] + "<|im_end|>\n" + CHAT[4]["content"] + "<|im_end|>\n"),
    "llama3": (CHAT, CHAT[2]["content"] + "<|eot_id|>" + CHAT[4]["content"] + "<|eot_id|>"),
    # the earlier turn as the conversation renders it (no reasoning); the last with its reasoning
    "qwen3": (THINKING, CHAT[2]["content"] + "<|im_end|>\n<think>\nVerse two.\n</think>\n\n"
              + CHAT[4]["content"] + "<|im_end|>\n"),
    "marked": (CHAT, CHAT[2]["content"] + "<|im_end|>" + CHAT[4]["content"] + "<|im_end|>"),
}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen3": QWEN3, "marked": MARKED}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_kind_of_template_trains_exactly_its_assistant_turns(tmp_path: Path, name: str):
    """ChatML, Llama-3 style, Qwen3 style (history rewritten: earlier reasoning dropped) and
    generation markers: the masked tokens are exactly the assistant text written out by hand, and
    the rendering is transformers'. Where transformers reads the markers itself
    (``return_assistant_tokens_mask``), its mask is ours."""
    transformers = require("transformers")
    folder = chat_folder(tmp_path, TEMPLATES[name])
    messages, expected = EXPECTED[name]
    tok = load_tokenizer(str(folder))
    ids, mask = tok.encode_chats([messages])[0]
    kept = tok._tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert kept == expected
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat.render(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert tok.chat.render(messages[:4], add_generation_prompt=True) == hf.apply_chat_template(
        messages[:4], tokenize=False, add_generation_prompt=True)
    if name == "marked":
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids and out["assistant_masks"] == mask


def test_a_template_whose_turns_cannot_be_found_is_refused(tmp_path: Path):
    """A template that renders an assistant turn's closing differently when the turn ends the
    conversation: neither the prefixes nor the probe can place it, so it is refused (one line)."""
    odd = CHATML.replace("<|im_end|>\n{% endfor %}",
                         "{{ '<|im_end|>' if loop.last else '<|eot_id|>' }}\n{% endfor %}")
    tok = load_tokenizer(str(chat_folder(tmp_path, odd)))
    with pytest.raises(ConfigError, match="assistant turn 3 so that its tokens cannot be found"):
        tok.encode_chats([CHAT])
