"""Data: packing with document boundaries, layout-independent order, resumable state, user files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.config import ConfigError, DataConfig
from shardwise.data.dataset import (
    IGNORE_INDEX,
    PackedLoader,
    TokenStream,
    _stream,
    check_vocab,
    load_corpus,
    read_documents,
    tokenize_corpus,
)
from shardwise.data.tokenizer import ByteTokenizer, load_tokenizer


def test_stream_packs_documents_with_bos_eos():
    s = _stream([[5, 6], [7]], bos=1, eos=2)
    assert s.tokens.tolist() == [1, 5, 6, 2, 1, 7, 2]
    assert s.doc_ids.tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_labels_that_start_another_document_are_ignored():
    s = _stream([[5, 6], [7, 8, 9]], bos=1, eos=2)
    inputs, labels, docs = s.window(0, 6)
    assert inputs.tolist() == [1, 5, 6, 2, 1, 7]
    assert labels.tolist() == [5, 6, 2, IGNORE_INDEX, 7, 8]  # eos -> bos crosses a boundary
    assert docs.tolist() == [0, 0, 0, 0, 1, 1]


def make_stream(n_tokens: int = 4000) -> TokenStream:
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 50, rng.integers(5, 40)).tolist() for _ in range(n_tokens // 20)]
    return _stream(docs, 1, 2)


def all_sequences(loader: PackedLoader) -> list[list[int]]:
    return [row for b in loader.next_step() for row in b.inputs.tolist()]


@pytest.mark.parametrize("dp,micro", [(1, 8), (1, 2), (2, 4), (4, 1), (8, 1)])
def test_global_batch_is_the_same_for_every_split(dp: int, micro: int):
    stream = make_stream()
    ref = PackedLoader(stream, 16, 8, 8, 0, 1, seed=3, document_mask=False)
    loaders = [PackedLoader(stream, 16, 8, micro, r, dp, seed=3, document_mask=False) for r in range(dp)]
    for _ in range(3):
        want = all_sequences(ref)
        got = [row for ld in loaders for row in all_sequences(ld)]
        assert got == want


def test_order_depends_on_seed_and_epochs_roll_over():
    stream = make_stream(800)
    a = PackedLoader(stream, 16, 8, 8, 0, 1, seed=1, document_mask=False)
    b = PackedLoader(stream, 16, 8, 8, 0, 1, seed=2, document_mask=False)
    assert all_sequences(a) != all_sequences(b)
    steps_per_epoch = a.n // 8
    for _ in range(steps_per_epoch):
        a.next_step()
    assert a.epoch == 1


def test_state_dict_resumes_the_same_sequence():
    stream = make_stream()
    a = PackedLoader(stream, 16, 4, 4, 0, 1, seed=0, document_mask=True)
    for _ in range(5):
        a.next_step()
    state = a.state_dict()
    want = [all_sequences(a) for _ in range(3)]
    b = PackedLoader(stream, 16, 4, 4, 0, 1, seed=0, document_mask=True)
    b.load_state_dict(state)
    assert [all_sequences(b) for _ in range(3)] == want


def test_batches_count_valid_labels_and_carry_doc_ids():
    stream = make_stream()
    (batch,) = PackedLoader(stream, 32, 4, 4, 0, 1, seed=0, document_mask=True).next_step()
    assert batch.n_valid == int((batch.labels != IGNORE_INDEX).sum())
    assert batch.n_valid < batch.labels.numel()  # boundaries inside 32-token windows
    assert batch.doc_ids is not None and batch.doc_ids.shape == batch.inputs.shape


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ConfigError, match="fewer than training.global_batch=64"):
        PackedLoader(make_stream(200), 16, 64, 64, 0, 1, seed=0, document_mask=False)


def test_shipped_corpus_and_tokenizer(tmp_path: Path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    tok = load_tokenizer("")
    assert tok.vocab_size == 2048
    train, val = load_corpus(cfg, tok)
    assert len(train.tokens) > 1_000_000 and len(val.tokens) > 10_000
    assert list(tmp_path.glob("tokens-*.npz")), "the tokenized corpus is cached"
    again = load_corpus(cfg, tok)[0]
    assert np.array_equal(again.tokens, train.tokens)
    assert tok.decode(train.tokens[:12].tolist()).startswith("Genesis 1\n")  # first chapter, in order
    check_vocab(train, 2048)
    with pytest.raises(ConfigError, match="beyond model.vocab_size=1000"):
        check_vocab(train, 1000)


def test_validation_documents_are_held_out(tmp_path: Path):
    docs = [{"text": f"document number {i} " * 5} for i in range(50)]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in docs))
    tok = ByteTokenizer()
    train, val = tokenize_corpus(DataConfig(path=str(f), val_fraction=0.1), tok)
    train_text = tok.decode(train.tokens.tolist())
    val_text = tok.decode(val.tokens.tolist())
    val_docs = {t for t in val_text.split("document number ") if t}
    assert len({d.split()[0] for d in val_docs}) == 5
    for d in {d.split()[0] for d in val_docs}:
        assert f"document number {d} " not in train_text


def write_user_data(tmp_path: Path, kind: str) -> Path:
    texts = ["first document text", "second one here", "third"]
    if kind == "txt":
        p = tmp_path / "a.txt"
        p.write_text("\n\n".join(texts))
    elif kind == "jsonl":
        p = tmp_path / "a.jsonl"
        p.write_text("\n".join(json.dumps({"content": t}) for t in texts))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / "a.parquet"
        pq.write_table(pa.table({"content": texts}), p)
    else:  # a folder of jsonl files
        p = tmp_path / "folder"
        p.mkdir()
        for i, t in enumerate(texts):
            (p / f"{i}.jsonl").write_text(json.dumps({"content": t}))
    return p


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "folder"])
def test_user_data_formats(tmp_path: Path, kind: str):
    path = write_user_data(tmp_path, kind)
    docs = read_documents(DataConfig(path=str(path), text_field="content"))
    assert sorted(docs) == sorted(["first document text", "second one here", "third"])


@pytest.mark.parametrize("name,content,fragment", [
    ("missing.jsonl", None, "does not exist"),
    ("e.jsonl", "", "is empty"),
    ("x.csv", "a,b", "holds no .txt, .jsonl"),
    ("w.jsonl", '{"body": "x"}', "data.text_field 'text' is not a column"),
    ("c.jsonl", '{"text": "x"\n', "could not be read as json"),
])
def test_bad_data_fails_with_one_line(tmp_path: Path, name: str, content: str | None, fragment: str):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        read_documents(DataConfig(path=str(path)))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode_batch(["héllo"])[0]
    assert tok.decode(ids) == "héllo" and max(ids) < 256


def test_bad_tokenizer_paths(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tmp_path / "none.json"))
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        load_tokenizer(str(bad))
