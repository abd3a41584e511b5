"""Preparation: streamed, parallel, resumable tokenization into memory-mapped shards.

The reference is independent: HF ``datasets`` reads the same files whole into memory and HF
``tokenizers`` encodes every document at once; the prepared shards must hold the same tokens, in the
same order, split by the same held-out rule.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardwise.config.schema import ConfigError, DataConfig
from shardwise.data import prepare as prep
from shardwise.data.dataset import PackedLoader, open_corpus
from shardwise.data.indexed import Shard
from shardwise.data.prepare import check_prepared, is_validation, prepare
from shardwise.data.tokenizer import SHIPPED_CORPUS, load_tokenizer

TOK = load_tokenizer("")
TOK_PATH = Path(__file__).parents[2] / "shardwise" / "data" / "assets" / "tokenizer.json"
real_write = prep.write_shard


def reference_documents(path: Path, builder: str, field: str = "text", sample_by: str = "paragraph",
                        ) -> list[str]:
    """Every document's text, read whole by HF datasets (the in-memory way)."""
    import datasets

    files = sorted(str(f) for f in path.rglob("*") if f.is_file()) if path.is_dir() else [str(path)]
    datasets.disable_progress_bars()
    kwargs = {"sample_by": sample_by} if builder == "text" else {}
    ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(path.parent / "hf"),
                               **kwargs)
    column = "text" if builder == "text" else field
    return [t for t in ds[column] if isinstance(t, str) and t.strip()]


def reference_tokens(texts: list[str], val_fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    from tokenizers import Tokenizer

    ids = [e.ids for e in Tokenizer.from_file(str(TOK_PATH)).encode_batch(texts, add_special_tokens=False)]
    docs = [[TOK.bos_id, *d, TOK.eos_id] for d in ids]
    val = [is_validation(t, val_fraction) for t in texts]
    return ([d for d, v in zip(docs, val, strict=True) if not v],
            [d for d, v in zip(docs, val, strict=True) if v])


def prepared_docs(where: Path, part: str) -> list[list[int]]:
    m = json.loads((where / "manifest.json").read_text())
    out = []
    for i in range(m["shards"]):
        shard = Shard(where / "shards" / f"{i:05d}.{part}")
        out += [shard.document(d).tolist() for d in range(shard.n_docs)]
    return out


def kjv_texts(n: int = 120) -> list[str]:
    with gzip.open(SHIPPED_CORPUS, "rt") as f:
        return [json.loads(line)["text"] for line in f][:n]


def write_corpus(tmp: Path, kind: str) -> tuple[Path, str, str]:
    """(path, datasets builder for the reference, txt_sample_by) of a small corpus with edge cases."""
    texts = kjv_texts()
    texts[3] = "   "  # whitespace only: skipped
    rows = [json.dumps({"text": t}) for t in texts]
    d = tmp / "src"
    d.mkdir()
    if kind.startswith("txt"):
        body = "\n\n".join(texts).replace("\n\n\n", "\n\n\n\n")  # runs of blank lines split oddly
        body = body[:20_000].replace("\n", "\r\n") + body[20_000:]  # CRLF part
        p = d / "a.txt"
        p.write_bytes(body.encode())
        return p, "text", kind.split("-")[1]
    if kind in ("jsonl.gz", "jsonl.zst"):  # the reference reads the plain file
        import zstandard

        plain = "\n".join(rows).encode()
        p = d / f"a.{kind}"
        compress = gzip.compress if kind.endswith("gz") else zstandard.ZstdCompressor().compress
        p.write_bytes(compress(plain))
        (tmp / "plain").mkdir()
        (tmp / "plain" / "a.jsonl").write_bytes(plain)
        return p, "json", "paragraph"
    if kind == "json-array":
        p = d / "a.json"
        p.write_text(json.dumps([{"text": t} for t in texts]))
        return p, "json", "paragraph"
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = d / "a.parquet"
        pq.write_table(pa.table({"text": texts}), p, row_group_size=25)
        return p, "parquet", "paragraph"
    for i in range(3):  # a folder of jsonl files, read in name order
        (d / f"{i}.jsonl").write_text("\n".join(rows[i * 40:(i + 1) * 40]) + "\n\n")
    return d, "json", "paragraph"


KINDS = ["txt-paragraph", "txt-line", "txt-document", "jsonl.gz", "jsonl.zst", "json-array", "parquet",
         "folder"]


@pytest.mark.parametrize("kind", KINDS)
def test_preparation_equals_in_memory_tokenization(tmp_path: Path, kind: str):
    path, builder, sample_by = write_corpus(tmp_path, kind)
    cfg = DataConfig(path=str(path), txt_sample_by=sample_by, val_fraction=0.1, shard_mb=0.02,
                     cache_dir=str(tmp_path / "cache"))
    (where,) = prepare(cfg, TOK, workers=1, quiet=True)
    ref_path = tmp_path / "plain" / "a.jsonl" if kind.startswith("jsonl.") else path
    train, val = reference_tokens(reference_documents(ref_path, builder, sample_by=sample_by), 0.1)
    assert prepared_docs(where, "train") == train and prepared_docs(where, "val") == val
    assert (len(val) > 0 and len(train) > len(val)) or kind == "txt-document"  # (one document)
    m = json.loads((where / "manifest.json").read_text())
    assert m["complete"] and m["docs"] == len(train) and m["tokens"] == sum(map(len, train))
    if kind not in ("txt-document", "json-array"):
        assert m["shards"] > 2  # several units, so their cuts are tested too


@pytest.fixture(scope="module")
def plain_kjv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("kjv") / "kjv.jsonl"
    p.write_bytes(gzip.decompress(SHIPPED_CORPUS.read_bytes()))
    return p


def shard_bytes(where: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((where / "shards").iterdir())
            if f.suffix in (".bin", ".idx")}


@pytest.mark.parametrize("source", ["plain", "gzip"])
def test_parallel_and_single_process_shards_are_identical(tmp_path: Path, plain_kjv: Path, source: str):
    path = plain_kjv if source == "plain" else SHIPPED_CORPUS
    out = {}
    for workers in (1, 2):
        cfg = DataConfig(path=str(path), shard_mb=0.6, prepared_dir=str(tmp_path / f"w{workers}"))
        (where,) = prepare(cfg, TOK, workers=workers, quiet=True)
        out[workers] = shard_bytes(where)
    assert len(out[1]) >= 4 * 6 and out[1] == out[2]


def test_interrupted_preparation_resumes_to_identical_shards(tmp_path: Path, plain_kjv: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    whole = DataConfig(path=str(plain_kjv), shard_mb=0.6, prepared_dir=str(tmp_path / "whole"))
    (want,) = prepare(whole, TOK, workers=1, quiet=True)
    cfg = DataConfig(path=str(plain_kjv), shard_mb=0.6, prepared_dir=str(tmp_path / "cut"))
    real, calls = prep.ShardWriter.close, []

    def crash_in_the_fourth(self: prep.ShardWriter) -> dict[str, int]:
        calls.append(self.prefix)
        if len(calls) == 7:  # shard 3's train part is on disk, its val part and record are not
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(prep.ShardWriter, "close", crash_in_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, TOK, workers=1, quiet=True)
    where = tmp_path / "cut" / want.name
    assert not json.loads((where / "manifest.json").read_text())["complete"]
    assert prep.shard_done(where, 2, TOK.fingerprint) and not prep.shard_done(where, 3, TOK.fingerprint)
    assert list((where / "shards").glob(".00003.*")), "the interrupted shard left only temporary files"
    with pytest.raises(ConfigError, match="not fully prepared"):
        open_corpus(cfg, TOK, prepare=False)
    monkeypatch.setattr(prep.ShardWriter, "close", real)
    rewritten = []
    monkeypatch.setattr(prep, "write_shard", lambda *a, **k: rewritten.append(a[1]) or real_write(*a, **k))
    prepare(cfg, TOK, workers=1, quiet=True)
    assert rewritten[0] == 3 and shard_bytes(where) == shard_bytes(want)
    assert not list((where / "shards").glob(".*"))


def test_training_reads_the_shards_memory_mapped_and_the_same_for_one_and_two_ranks(tmp_path: Path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    corpus = open_corpus(cfg, TOK)
    assert corpus.names == ["kjv"] and corpus.max_token < 2048
    assert all(isinstance(s.tokens, np.memmap) for s in corpus.train[0].shards)
    one = PackedLoader(corpus.train, 128, 8, 8, 0, 1, seed=5, document_mask=True)
    two = [PackedLoader(corpus.train, 128, 8, 2, r, 2, seed=5, document_mask=True) for r in range(2)]
    for _ in range(3):
        want = [b.inputs for b in one.next_step()]
        got = [b.inputs for ld in two for b in ld.next_step()]
        assert np.array_equal(np.concatenate(want), np.concatenate(got))
    assert TOK.decode(corpus.train[0].window(0, 12)[0].tolist()).startswith("Genesis 1\n")


def write_rows(tmp: Path, rows: list[str]) -> Path:
    p = tmp / "rows.jsonl"
    p.write_bytes("\n".join(rows).encode("utf-8", errors="surrogateescape"))
    return p


@pytest.mark.parametrize("row,fragment", [
    ('{"text": "x"', "row 3: not valid JSON"),
    ('{"body": "x"}', "row 3: no 'text' field"),
    ('{"text": 5}', "row 3: 'text' is int, not a string"),
    ('["text"]', "row 3: a JSON list, not an object"),
    ('{"text": "caf\udce9"}', "row 3: not UTF-8"),
])
def test_an_unreadable_row_is_one_line_naming_file_and_row_or_skipped_and_counted(
        tmp_path: Path, row: str, fragment: str):
    good = [json.dumps({"text": f"document {i}"}) for i in range(6)]
    path = write_rows(tmp_path, good[:2] + [row] + good[2:])
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "c"), val_fraction=0)
    with pytest.raises(ConfigError) as e:
        prepare(cfg, TOK, quiet=True)
    assert fragment in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    assert "data.skip_bad_rows" in str(e.value)
    cfg.skip_bad_rows = True
    (where,) = prepare(cfg, TOK, quiet=True)
    m = json.loads((where / "manifest.json").read_text())
    assert (m["bad_rows"], m["docs"]) == (1, 6)


def test_a_changed_source_no_longer_matches_its_manifest(tmp_path: Path):
    path = write_rows(tmp_path, [json.dumps({"text": f"doc {i}"}) for i in range(5)])
    cfg = DataConfig(path=str(path), prepared_dir=str(tmp_path / "p"))
    prepare(cfg, TOK, quiet=True)
    check_prepared(cfg, TOK)
    path.write_text(path.read_text() + "\n" + json.dumps({"text": "one more"}))
    for call in (lambda: check_prepared(cfg, TOK), lambda: prepare(cfg, TOK, quiet=True)):
        with pytest.raises(ConfigError, match="changed since .* was prepared") as e:
            call()
        assert "\n" not in str(e.value)
    other = DataConfig(path=str(path), prepared_dir=str(tmp_path / "p"), val_fraction=0.5)
    with pytest.raises(ConfigError, match="was made with val_fraction=0.02, this run has 0.5"):
        check_prepared(other, load_tokenizer(""))


@pytest.mark.parametrize("damage", ["truncate", "other_tokenizer"])
def test_a_damaged_or_foreign_shard_is_one_line_and_prepare_rewrites_it(tmp_path: Path, damage: str):
    cfg = DataConfig(prepared_dir=str(tmp_path / "p"), shard_mb=0.6)
    (where,) = prepare(cfg, TOK, workers=1, quiet=True)
    want = shard_bytes(where)
    if damage == "truncate":
        f = where / "shards" / "00002.train.bin"
        f.write_bytes(f.read_bytes()[:-100])
    else:
        rec = where / "shards" / "00002.json"
        rec.write_text(rec.read_text().replace(TOK.fingerprint, "0123456789abcdef"))
    with pytest.raises(ConfigError, match="00002' is truncated, missing or from another tokenizer") as e:
        open_corpus(cfg, TOK, prepare=False)
    assert "shardwise prepare" in str(e.value) and "\n" not in str(e.value)
    (where / "manifest.json").write_text(  # what an interrupted run leaves: prepare picks it up
        (where / "manifest.json").read_text().replace('"complete": true', '"complete": false'))
    prepare(cfg, TOK, workers=1, quiet=True)
    assert shard_bytes(where) == want


def test_mixed_sources_and_a_validation_path(tmp_path: Path, plain_kjv: Path):
    shutil.copy(plain_kjv, tmp_path / "kjv.jsonl")
    val = write_rows(tmp_path, [json.dumps({"text": f"held out {i} " * 40}) for i in range(30)])
    cfg = DataConfig(sources=[{"path": str(tmp_path / "kjv.jsonl"), "weight": 3},
                              {"path": str(SHIPPED_CORPUS), "weight": 1, "name": "again"}],
                     val_path=str(val), cache_dir=str(tmp_path / "c"))
    corpus = open_corpus(cfg, TOK)
    assert corpus.names == ["kjv", "again"] and corpus.weights == [3.0, 1.0]
    assert [s.n_tokens for s in corpus.train] == [corpus.train[0].n_tokens] * 2  # same text, all train
    assert len(corpus.val) == 1 and corpus.val[0].n_tokens > 30 * 40 * 2
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight must be > 0"):
        open_corpus(DataConfig(sources=[{"path": str(val)}, {"path": str(val), "weight": 0}]), TOK)
    with pytest.raises(ConfigError, match="names repeat"):
        open_corpus(DataConfig(sources=[{"path": str(val)}, {"path": str(val)}]), TOK)
    with pytest.raises(ConfigError, match="a data source is named 'val'"):
        open_corpus(DataConfig(sources=[{"path": str(val), "name": "val"}], val_path=str(val)), TOK)


@pytest.mark.parametrize("name,content,fragment", [
    ("missing.jsonl", None, "data.path '{p}' does not exist"),
    ("e.jsonl", "", "data file '{p}' is empty"),
    ("x.csv", "a,b", "data.path '{p}' holds no .txt, .jsonl"),
    ("w.jsonl", '{"body": "x"}', "row 1: no 'text' field"),
    ("big.json", "[", "is not valid JSON"),
])
def test_bad_data_fails_with_one_line(tmp_path: Path, name: str, content: str | None, fragment: str):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        prepare(DataConfig(path=str(path), cache_dir=str(tmp_path / "c")), TOK, quiet=True)
    assert fragment.format(p=path) in str(e.value) and "\n" not in str(e.value)


def test_a_folder_of_two_kinds_is_refused(tmp_path: Path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}')
    with pytest.raises(ConfigError, match="mixes file kinds .* make each its own data.sources entry"):
        check_prepared(DataConfig(path=str(tmp_path)), TOK)
