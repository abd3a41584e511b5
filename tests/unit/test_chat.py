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


def _varied_chats(path: Path, n: int = 60, long: int = 3) -> Path:
    """``n`` conversations of 1 to 6 exchanges (so that contiguous windows would cut many of them),
    the last ``long`` of them far longer than a 384-token window."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        turns = 40 if i >= n - long else int(rng.integers(1, 7))
        msgs = [{"role": "system", "content": f"Conversation {i}."}]
        for t in range(turns):
            msgs += [{"role": "user", "content": f"Verse {t} of chapter {i}?"},
                     {"role": "assistant", "content": "And God said, Let there be light" + "." * (t % 3)}]
        rows.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_chat_windows_hold_whole_conversations(tmp_path: Path):
    """Conversations that straddle window edges when the stream is cut contiguously are packed whole:
    each window holds conversations from their first token (a conversation longer than the window
    from its first token to the cut), every conversation exactly once, pad rows without loss; a
    label counts iff it is an assistant token of its own conversation; the packing is the same for a
    data-parallel split of the batch; preparation reports efficiency and the truncation."""
    from shardwise.data.dataset import DocumentStream, packing_notices

    cfg = _chat_cfg(tmp_path, path=str(_varied_chats(tmp_path / "chats.jsonl")), val_fraction=0.0)
    corpus = open_corpus(cfg.data, load_tokenizer(""))
    (stream,) = corpus.train
    assert isinstance(stream, DocumentStream)
    seq = 384
    base = stream.base
    lengths = base.doc_lengths()
    # Cut contiguously, windows would split conversations: the case this packing exists for.
    edges = np.arange(seq, int(lengths.sum()), seq)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    assert np.isin(edges, starts).mean() < 0.5
    docs = [base.document(d) for d in range(len(lengths))]
    seen, counted = [], 0
    for i in range(stream.num_windows(seq)):
        inputs, labels, doc_ids = stream.window(i, seq)
        for j in np.unique(doc_ids):
            at = np.flatnonzero(doc_ids == j)
            pos = int(at[0])
            match = [d for d, (t, _) in enumerate(docs) if len(t) > 1
                     and np.array_equal(t[:len(at)], inputs[at]) and d not in seen]
            if not match:  # pad: no label counts in it, nor on the way into it
                assert j == doc_ids.max() and (labels[max(pos - 1, 0):] == IGNORE_INDEX).all()
                continue
            d = match[0]
            seen.append(d)
            t, m = docs[d]
            kept = min(len(t), seq + 1)
            assert len(at) == min(kept, seq - pos)  # whole from its first token, or cut by the window
            valid = labels[at] != IGNORE_INDEX
            n = min(len(at), kept - 1)  # labels inside the conversation (its last input's is the next's)
            np.testing.assert_array_equal(valid[:n], m[1:1 + n].astype(bool))
            assert not valid[n:].any()
            counted += int(valid.sum())
    assert sorted(seen) == list(range(len(lengths)))  # every conversation, once
    assert counted == sum(int(m[1:min(len(t), seq + 1)].sum()) for t, m in docs)
    p = stream.packing(seq)
    assert p.truncated == 3 and 0.5 < p.efficiency <= 1
    lines = packing_notices(corpus, seq)
    assert "packing efficiency" in lines[0] and f"{100 * p.efficiency:.1f}%" in lines[0]
    assert lines[1].startswith("notice: data ") and "3 conversations are longer" in lines[1]
    # A data-parallel split of the global batch reads the same rows.
    one = PackedLoader(corpus.train, seq, 8, 8, 0, 1, seed=0, document_mask=True)
    two = [PackedLoader(corpus.train, seq, 8, 2, r, 2, seed=0, document_mask=True) for r in range(2)]
    for _ in range(3):
        (ref,) = one.next_step()
        parts = [b for loader in two for b in loader.next_step()]
        np.testing.assert_array_equal(np.concatenate([b.labels for b in parts]), ref.labels)
        np.testing.assert_array_equal(np.concatenate([b.doc_ids for b in parts]), ref.doc_ids)


def test_packing_is_kept_and_a_damaged_one_recomputed(tmp_path: Path):
    """The packing is written once beside the shards and read back; a damaged file is recomputed
    (and replaced), never trusted."""
    from shardwise.data.packing import cached_packing, pack

    lengths = np.random.default_rng(1).integers(1, 300, size=500)
    first = cached_packing(tmp_path, "train", lengths, 257)
    path = tmp_path / "packing" / "train-256.npz"
    assert path.exists()
    again = cached_packing(tmp_path, "train", lengths, 257)
    np.testing.assert_array_equal(again.order, first.order)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a bit flip inside the archive
    path.write_bytes(bytes(raw))
    fixed = cached_packing(tmp_path, "train", lengths, 257)
    np.testing.assert_array_equal(fixed.order, pack(lengths, 257).order)
    # Every window within capacity, every document once.
    sizes = np.add.reduceat(np.minimum(lengths, 257)[fixed.order], fixed.starts[:-1])
    assert (sizes <= 257).all() and sorted(fixed.order.tolist()) == list(range(500))


def test_packing_is_best_fit_decreasing():
    """Each document, longest first within its buffer, goes to the fullest open window it fits: on
    windows of 10 tokens, lengths 8, 6, 3, 1 pack as {8} {6, 3, 1} (first-fit would make {8, 1} {6, 3}),
    and a replay of a 3,000-document packing (buffers of 512) finds every placement was the best fit."""
    from shardwise.data.packing import pack

    small = pack(np.array([8, 6, 3, 1]), 10)
    assert [sorted(small.order[a:b].tolist()) for a, b in zip(small.starts[:-1], small.starts[1:],
                                                                       strict=True)] == [[0], [1, 2, 3]]
    lengths = np.random.default_rng(2).integers(1, 400, size=3000)
    cap, buffer = 257, 512
    p = pack(lengths, cap, buffer=buffer)
    kept = np.minimum(lengths, cap)
    window = np.empty(len(lengths), dtype=np.int64)
    for w, (a, b) in enumerate(zip(p.starts[:-1], p.starts[1:], strict=True)):
        window[p.order[a:b]] = w
    shuffled = np.random.default_rng(0).permutation(len(lengths))  # PACK_SEED's order
    room: dict[int, int] = {}  # open windows of this buffer: tokens left
    for lo in range(0, len(lengths), buffer):
        room.clear()
        docs = shuffled[lo:lo + buffer]
        for d in docs[np.argsort(-kept[docs], kind="stable")].tolist():
            fits = [r for r in room.values() if r >= kept[d]]
            w = int(window[d])
            if w not in room:  # a new window: only when no open one fits
                assert not fits, (d, kept[d], fits)
                room[w] = cap
            assert room[w] == min(fits or [cap]), (d, room[w], min(fits or [cap]))
            room[w] -= int(kept[d])
    assert p.windows == len({int(w) for w in window})


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


def _strict_folder(tmp_path: Path, template: str) -> str:
    """The shipped tokenizer with ``template`` as its chat template."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((ASSETS / "tokenizer.json").read_bytes())
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_template_that_raises_on_a_row_is_that_rows_error(tmp_path: Path):
    """A template that raises (raise_exception, as HF templates refuse roles out of order) on row 2:
    one line naming the file and row, and data.skip_bad_rows skips and counts it (it was a 55-line
    jinja2 traceback, skip_bad_rows ignored)."""
    shipped = json.loads((ASSETS / "tokenizer_config.json").read_text())["chat_template"]
    strict = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversations must start "
              "with a user or system turn') }}{% endif %}" + shipped)
    rows = [CHAT, [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hello?"},
                   {"role": "assistant", "content": "Yes."}], CHAT]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    cfg = _chat_cfg(tmp_path, path=str(data), tokenizer=_strict_folder(tmp_path, strict), val_fraction=0.0)
    tok = load_tokenizer(cfg.data.tokenizer)
    with pytest.raises(DataError, match=r"chats.jsonl' row 2: the chat template raised TemplateError: "
                                        r"Conversations must start with a user or system turn \(data.skip"):
        open_corpus(cfg.data, tok)
    cfg.data.skip_bad_rows = True
    corpus = open_corpus(cfg.data, tok)
    assert sum(s.base.doc_lengths().size for s in corpus.train) == 2  # the two good conversations


def test_a_template_that_never_ends_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from shardwise.data import chat

    monkeypatch.setattr(chat, "RENDER_LIMIT_S", 0.5)
    endless = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = load_tokenizer(_strict_folder(tmp_path, endless))
    with pytest.raises(chat.TemplateRaised, match="took more than 0.5 s to render"):
        tok.render_chat(CHAT)


def test_a_tokenizer_config_that_is_not_an_object_is_one_line(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_bytes((ASSETS / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list, not an object of tokenizer settings"):
        load_tokenizer(str(tmp_path))
