"""Data loading: packing with document boundaries, layout-independent order, mixing, resumable
state, the memory-mapped shard format. (Preparation from files: test_prepare.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardwise.config.schema import ConfigError
from shardwise.data.dataset import IGNORE_INDEX, PackedLoader, ShardStream, TokenStream, check_vocab
from shardwise.data.indexed import HEADER, Shard, ShardError, ShardWriter, token_dtype
from shardwise.data.tokenizer import ByteTokenizer, load_tokenizer


def _stream(docs: list[list[int]], bos: int, eos: int) -> TokenStream:
    """The in-memory reference: [bos] + doc + [eos], concatenated, with each token's document."""
    packed = [[bos, *d, eos] for d in docs]
    return TokenStream(np.array([t for d in packed for t in d]),
                       np.repeat(np.arange(len(docs)), [len(d) for d in packed]))


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
    a = PackedLoader(stream, 16, 8, 8, 0, 1, seed=1, document_mask=False)
    n = a.n[0]
    seen = [row for _ in range(n // 8) for row in all_sequences(a)]
    assert len(seen) == n - n % 8 and len({tuple(r) for r in seen}) == len(seen)  # no repeat in an epoch
    a.next_step()
    assert a.consumed == [n // 8 * 8 + 8]


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


def test_vocab_check():
    check_vocab(2047, 2048)
    with pytest.raises(ConfigError, match="beyond model.vocab_size=1000"):
        check_vocab(2047, 1000)


def write_shards(tmp_path: Path, docs: list[list[int]], per_shard: int, vocab: int = 60) -> list[Path]:
    prefixes = []
    for k in range(0, len(docs), per_shard):
        w = ShardWriter(tmp_path / f"{k:05d}.train", token_dtype(vocab))
        w.add([np.array([1, *d, 2]) for d in docs[k:k + per_shard]])
        w.close()
        prefixes.append(tmp_path / f"{k:05d}.train")
    return prefixes


def test_memory_mapped_shards_read_as_the_in_memory_stream(tmp_path: Path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 50, rng.integers(1, 40)).tolist() for _ in range(300)]
    ref = _stream(docs, 1, 2)
    shards = ShardStream(write_shards(tmp_path, docs, per_shard=37))  # windows span shard ends
    assert len(shards.shards) == 9 and shards.n_tokens == len(ref.tokens)
    for seq in (7, 16, 61):
        assert shards.num_windows(seq) == ref.num_windows(seq)
        for i in range(ref.num_windows(seq)):
            for a, b in zip(shards.window(i, seq), ref.window(i, seq), strict=True):
                assert a.tolist() == b.tolist()
    assert shards.max_token() == max(max(d) for d in docs)


def test_shards_are_megatron_indexed_datasets(tmp_path: Path):
    """The .idx layout Megatron-Core's IndexedDataset reads: header, version 1, dtype code, counts,
    int32 lengths, int64 byte pointers, int64 document indices."""
    (prefix,) = write_shards(tmp_path, [[5, 6], [7]], per_shard=10)
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == HEADER and int.from_bytes(raw[9:17], "little") == 1
    assert raw[17] == 1  # uint8 for a 60-token vocabulary
    n, d = int.from_bytes(raw[18:26], "little"), int.from_bytes(raw[26:34], "little")
    assert (n, d) == (2, 3)
    body = np.frombuffer(raw[34:34 + 8], np.int32).tolist(), np.frombuffer(raw[42:58], np.int64).tolist()
    assert body == ([4, 3], [0, 4]) and np.frombuffer(raw[58:], np.int64).tolist() == [0, 1, 2]
    assert Path(f"{prefix}.bin").read_bytes() == bytes([1, 5, 6, 2, 1, 7, 2])
    assert Shard(prefix).document(1).tolist() == [1, 7, 2]
    assert [token_dtype(v) for v in (256, 257, 65536, 65537)] == [np.uint8, np.uint16, np.uint16, np.int32]


@pytest.mark.parametrize("damage", ["truncate_bin", "truncate_idx", "garbage_idx"])
def test_a_damaged_shard_is_refused(tmp_path: Path, damage: str):
    (prefix,) = write_shards(tmp_path, [[5, 6], [7]], per_shard=10)
    path = Path(f"{prefix}.{damage.split('_')[1]}")
    data = path.read_bytes()
    path.write_bytes(b"x" * len(data) if damage == "garbage_idx" else data[:-1])
    with pytest.raises(ShardError) as e:
        Shard(prefix)
    assert "\n" not in str(e.value)


def mix(streams: list[TokenStream], weights: list[float], dp: int = 1, rank: int = 0, micro: int = 8,
        seed: int = 0) -> PackedLoader:
    return PackedLoader(streams, 16, 8, micro, rank, dp, seed=seed, document_mask=False,
                        weights=weights, names=["a", "b", "c"][:len(streams)])


def test_mixing_follows_the_weights_and_tracks_each_source_epoch():
    streams = [make_stream(4000), make_stream(800), make_stream(2000)]
    loader = mix(streams, [0.5, 0.2, 0.3])
    for _ in range(50):
        loader.next_step()
        total = sum(loader.consumed)  # within one sequence of its weight, at every step
        assert all(abs(c - w * total) <= 1 for c, w in zip(loader.consumed, [0.5, 0.2, 0.3], strict=True))
    assert loader.consumed == [200, 80, 120]  # 400 sequences: exact at every whole multiple
    m = loader.mix_metrics()
    assert m["data/a_share"] == 0.5 and m["data/b_share"] == 0.2
    assert m["data/b_epoch"] == 80 / loader.n[1] > 1  # the small source went round more than once


@pytest.mark.parametrize("dp,micro", [(2, 4), (4, 1)])
def test_a_mix_is_the_same_for_every_split_and_resumes_exactly(dp: int, micro: int):
    streams = [make_stream(4000), make_stream(800)]
    ref = mix(streams, [0.7, 0.3])
    for _ in range(4):
        ref.next_step()
    state = ref.state_dict()
    want = [all_sequences(ref) for _ in range(30)]
    assert ref.consumed[1] > ref.n[1]  # the small source went into its second epoch
    loaders = [mix(streams, [0.7, 0.3], dp, r, micro) for r in range(dp)]
    for ld in loaders:
        ld.load_state_dict(state)
    assert [[row for ld in loaders for row in all_sequences(ld)] for _ in range(30)] == want
    other = mix(streams, [0.7, 0.3], seed=1)
    other.load_state_dict(state)  # the seed is the run's; a different one is another order
    assert all_sequences(other) != want[0]
    with pytest.raises(ConfigError, match="data sources were"):
        mix(streams[:1], [1.0]).load_state_dict(state)


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
