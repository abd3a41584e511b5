"""``data.synthetic``: seeded random token ids over the model's whole vocabulary, read from no file --
what lets ``verify`` (and a step-time run) take a family's preset on a machine without its tokenizer:
the same windows for every seed's run, every id range a vocab-parallel shard holds, document
boundaries at any sequence length, and one-line refusals where a corpus is asked for beside it."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.cli import main
from shardwise.config.schema import ConfigError
from shardwise.data.dataset import IGNORE_INDEX, PackedLoader, SyntheticStream, open_corpus, synthetic_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.resolve.checks import load_config
from shardwise.resolve.preflight import check_tokenizer
from shardwise.resolve.run import resolve_model

V = 128_256  # (Llama 3's vocabulary: what the 405B plan's tp=8 cuts in 8 x 16,032 rows)


def test_a_window_is_the_same_for_the_same_seed_and_another_for_another():
    a, b, other = SyntheticStream(V, 42, 0), SyntheticStream(V, 42, 0), SyntheticStream(V, 43, 0)
    for i in (0, 7, 1 << 19):
        assert all(np.array_equal(x, y) for x, y in zip(a.window(i, 64), b.window(i, 64), strict=True))
        assert not np.array_equal(a.window(i, 64)[0], other.window(i, 64)[0])
    assert not np.array_equal(a.window(0, 64)[0], a.window(1, 64)[0])
    held_out = SyntheticStream(V, 42, 1)
    assert not np.array_equal(a.window(0, 64)[0], held_out.window(0, 64)[0])
    assert (a.num_windows(64), held_out.num_windows(64)) == (1 << 20, 1 << 14)


def test_ids_cover_every_vocab_parallel_shard_and_documents_split_the_windows():
    s = SyntheticStream(V, 0, 0)
    windows = [s.window(i, 256) for i in range(64)]
    ids = np.concatenate([w[0] for w in windows])
    assert ids.min() >= 0 and ids.max() < V
    assert (np.bincount(ids // (V // 8), minlength=8) > 0).all()  # each tp=8 rank's rows are looked up
    assert ids.max() > 0.99 * V and ids.min() < 0.01 * V
    docs = [int(w[2].max()) + 1 for w in windows]
    assert 1.5 < np.mean(docs) < 5 and min(docs) >= 1  # (half a window on average: ~3 per window)
    for inputs, labels, doc_ids in windows:  # a label in the next document is out of the loss
        cut = np.flatnonzero(np.diff(doc_ids)) if len(doc_ids) > 1 else []
        assert all(labels[c] == IGNORE_INDEX for c in cut)
        kept = labels != IGNORE_INDEX
        assert np.array_equal(labels[:-1][kept[:-1]], inputs[1:][kept[:-1]])


def test_the_corpus_trains_a_loader_as_any_source_does():
    corpus = synthetic_corpus(V, 42)
    assert (corpus.names, corpus.max_token) == (["synthetic"], V - 1)
    one = PackedLoader(corpus.train, 64, 8, 8, 0, 1, 42, document_mask=True)
    halves = [PackedLoader(corpus.train, 64, 8, 2, r, 2, 42, document_mask=True) for r in (0, 1)]
    whole = one.next_step()[0].inputs
    split = [b.inputs for ld in halves for b in ld.next_step()]
    assert np.array_equal(whole.numpy(), np.concatenate([t.numpy() for t in split]))


@pytest.mark.parametrize("extra,named", [(["--data.path=corpus.jsonl"], "data.path"),
                                         (["--data.format=chat"], "data.format=chat"),
                                         (["--training.epochs=1"], "training.epochs")])
def test_a_corpus_beside_it_is_refused_in_one_line(extra: list[str], named: str):
    with pytest.raises(ConfigError, match=f"data.synthetic=true trains on random token ids, not on {named}"):
        load_config(None, ["--model.name=debug", "--data.synthetic=true", *extra])


def test_nothing_is_prepared_or_scored_from_it(capsys):
    cfg = load_config(None, ["--model.name=debug", "--data.synthetic=true"])
    with pytest.raises(ConfigError, match="no corpus to prepare, show or score"):
        open_corpus(cfg.data, load_tokenizer(""))
    # `shardwise prepare` says so too, rather than preparing nothing and exiting 0
    assert main(["prepare", "--model", "debug", "--data.synthetic=true"]) == 2
    assert "no corpus to prepare, show or score" in capsys.readouterr().err


def test_a_family_preset_without_its_tokenizer_is_refused_naming_synthetic_and_trains_with_it(capsys):
    plain = load_config(None, ["--model.name=8b"])
    with pytest.raises(ConfigError, match=r"Llama 3 tokenizer, --data.tokenizer DIR .* --data.synthetic"):
        check_tokenizer(plain, resolve_model(plain), 2048)
    synthetic = load_config(None, ["--model.name=8b", "--data.synthetic=true"])
    check_tokenizer(synthetic, resolve_model(synthetic), 2048)
    assert "data.synthetic: seeded random token ids over all 128,256 rows" in capsys.readouterr().out
