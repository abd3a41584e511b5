"""Packed causal-LM data: documents -> one token stream with boundaries -> fixed-length windows.

Each document is tokenized as ``[bos] + tokens + [eos]`` and concatenated. Window ``i`` is
``stream[i*S : i*S + S + 1]`` (inputs and labels shifted by one). A label that belongs to a different
document than its input is ignored: nothing in one chapter predicts the start of the next.

Order is layout-independent: step ``t`` consumes global sequences ``perm[t*G : (t+1)*G]`` of a
seeded per-epoch permutation, data-parallel rank ``r`` takes the r-th contiguous slice of those
``G`` and splits it into micro-batches. Any (dp, micro-batch) split of the same global batch sees
the same tokens, which is what lets every layout reproduce the single-device run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwise.config import ConfigError, DataConfig
from shardwise.data.tokenizer import ASSETS, Tokenizer

IGNORE_INDEX = -100
SHIPPED_CORPUS = ASSETS / "kjv.jsonl.gz"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_CACHE_VERSION = 1


def data_files(path: str) -> tuple[str, list[Path]]:
    """Resolve ``data.path`` to (datasets builder name, files); raise a one-line error if unusable."""
    p = Path(path).expanduser() if path else SHIPPED_CORPUS
    if not p.exists():
        raise ConfigError(f"data.path '{path}' does not exist: give a .txt/.jsonl/.parquet file or a "
                          "folder of them (empty = shipped corpus)")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    kinds = {}
    for f in files:
        suffixes = [s for s in f.suffixes if s != ".gz"]
        if suffixes and suffixes[-1] in _BUILDERS:
            kinds[f] = _BUILDERS[suffixes[-1]]
    if not kinds:
        raise ConfigError(f"data.path '{path}' holds no .txt, .jsonl, .json or .parquet files")
    builders = set(kinds.values())
    if len(builders) > 1:
        raise ConfigError(f"data.path '{path}' mixes file kinds ({', '.join(sorted(builders))}); "
                          "keep one kind per folder")
    empty = [f for f in kinds if f.stat().st_size == 0]
    if empty:
        raise ConfigError(f"data file '{empty[0]}' is empty: remove it or point data.path elsewhere")
    return builders.pop(), list(kinds)


def read_documents(cfg: DataConfig) -> list[str]:
    """Load every document's text with HF ``datasets`` local loading."""
    import datasets

    builder, files = data_files(cfg.path)
    kwargs = {"sample_by": cfg.txt_sample_by} if builder == "text" else {}
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it logs each parse failure, then raises
    try:
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                   **kwargs)
    except Exception as e:  # datasets wraps the parser's error (e.g. "JSON parse error ... in row 1")
        inner = e.__cause__ or e.__context__ or e if type(e).__name__ == "DatasetGenerationError" else e
        why = str(inner).splitlines()[0] if str(inner) else type(inner).__name__
        raise ConfigError(f"data.path '{cfg.path or SHIPPED_CORPUS}' could not be read as {builder}: "
                          f"{why}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    field = "text" if builder == "text" else cfg.text_field
    if field not in ds.column_names:
        raise ConfigError(f"data.text_field '{field}' is not a column of {cfg.path}; columns: "
                          f"{', '.join(ds.column_names)}")
    return [t for t in ds[field] if isinstance(t, str) and t.strip()]


@dataclass
class TokenStream:
    """Concatenated documents: ``tokens[i]`` and the index of the document it came from."""

    tokens: np.ndarray  # (N,) int32
    doc_ids: np.ndarray  # (N,) int32

    def num_windows(self, seq_len: int) -> int:
        return max(0, (len(self.tokens) - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, doc_ids) of window ``i``, each (seq_len,)."""
        lo, hi = i * seq_len, i * seq_len + seq_len + 1
        toks, docs = self.tokens[lo:hi].astype(np.int64), self.doc_ids[lo:hi]
        labels = toks[1:].copy()
        labels[docs[1:] != docs[:-1]] = IGNORE_INDEX  # next token starts another document
        return toks[:-1], labels, docs[:-1]


def _stream(docs: list[list[int]], bos: int, eos: int, first_doc: int = 0) -> TokenStream:
    lengths = np.array([len(d) + 2 for d in docs], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=np.int32)
    pos = 0
    for d in docs:
        tokens[pos] = bos
        tokens[pos + 1: pos + 1 + len(d)] = d
        tokens[pos + 1 + len(d)] = eos
        pos += len(d) + 2
    doc_ids = np.repeat(np.arange(first_doc, first_doc + len(docs), dtype=np.int32), lengths)
    return TokenStream(tokens, doc_ids)


def tokenize_corpus(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[TokenStream, TokenStream]:
    """Read, split (held-out documents by a fixed permutation) and tokenize: (train, val)."""
    texts = read_documents(cfg)
    if not texts:
        raise ConfigError(f"data.path '{cfg.path}' contains no non-empty documents")
    order = np.random.default_rng(0).permutation(len(texts))  # fixed: same val set for any seed
    n_val = min(len(texts) - 1, round(cfg.val_fraction * len(texts))) if cfg.val_fraction else 0
    n_val = max(n_val, 1) if cfg.val_fraction and len(texts) > 1 else n_val
    val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
    encoded = tokenizer.encode_batch(texts)
    train = _stream([encoded[i] for i in train_idx], tokenizer.bos_id, tokenizer.eos_id)
    val = _stream([encoded[i] for i in val_idx], tokenizer.bos_id, tokenizer.eos_id)
    return train, val


def cache_path(cfg: DataConfig, tokenizer: Tokenizer) -> Path:
    """Cache file keyed by the data files (path, size, mtime), the tokenizer and the split."""
    _, files = data_files(cfg.path)
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps([_CACHE_VERSION, tokenizer.fingerprint, cfg.text_field, cfg.txt_sample_by,
                         cfg.val_fraction]).encode())
    return Path(cfg.cache_dir).expanduser() / f"tokens-{h.hexdigest()[:20]}.npz"


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer, build: bool = True,
                barrier: Callable[[], None] | None = None) -> tuple[TokenStream, TokenStream]:
    """Tokenized (train, val), from the cache when present.

    Only a caller with ``build=True`` (rank 0, or the launcher before it spawns ranks) writes the
    cache; the others wait at ``barrier`` and read it. The write is atomic (temp file + rename).
    """
    path = cache_path(cfg, tokenizer)
    if build and not path.exists():
        train, val = tokenize_corpus(cfg, tokenizer)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
            np.savez(tmp, train_tokens=train.tokens, train_docs=train.doc_ids,
                     val_tokens=val.tokens, val_docs=val.doc_ids)
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache dir only costs re-tokenizing; the others fall back below
    if barrier is not None:
        barrier()
    if path.exists():
        z = np.load(path)
        return (TokenStream(z["train_tokens"], z["train_docs"]),
                TokenStream(z["val_tokens"], z["val_docs"]))
    return tokenize_corpus(cfg, tokenizer)


def check_vocab(train: TokenStream, vocab_size: int) -> None:
    top = int(train.tokens.max()) if len(train.tokens) else -1
    if top >= vocab_size:
        raise ConfigError(f"token id {top} is beyond model.vocab_size={vocab_size}: raise "
                          "model.vocab_size to at least the tokenizer's vocabulary")


@dataclass
class Batch:
    """One micro-batch on one rank. ``n_valid`` counts labels that are not ``IGNORE_INDEX``."""

    inputs: torch.Tensor  # (B, S) int64
    labels: torch.Tensor  # (B, S) int64
    doc_ids: torch.Tensor | None  # (B, S) int32 when document masking is on
    n_valid: int
    first_row: int = 0  # the global batch's sequence this micro-batch starts at (all ranks counted)


class PackedLoader:
    """Stateful, deterministic loader of this rank's micro-batches for each optimizer step."""

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, document_mask: bool,
                 device: torch.device | str = "cpu", shuffle: bool = True) -> None:
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.seed, self.document_mask, self.device, self.shuffle = seed, document_mask, device, shuffle
        self.n = stream.num_windows(seq_len)
        if self.n < global_batch:
            raise ConfigError(f"the data has {self.n} sequences of {seq_len} tokens, fewer than "
                              f"training.global_batch={global_batch}: use more data or shorter "
                              "sequences")
        self.epoch, self.position = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step (the epoch rolls over as needed)."""
        if self.position + self.global_batch > self.n:  # drop the ragged tail of an epoch
            self.epoch, self.position = self.epoch + 1, 0
            self._perm = self._permutation()
        step = self._perm[self.position: self.position + self.global_batch]
        self.position += self.global_batch
        per_rank = self.global_batch // self.dp_size
        first = self.dp_rank * per_rank
        mine = step[first: first + per_rank]
        return [self._batch(mine[i: i + self.micro_batch], first + i)
                for i in range(0, per_rank, self.micro_batch)]

    def _batch(self, idx: np.ndarray, first_row: int) -> Batch:
        parts = [self.stream.window(int(i), self.seq_len) for i in idx]
        inputs, labels, docs = (np.stack(p) for p in zip(*parts, strict=True))
        to = dict(device=self.device, non_blocking=True)
        return Batch(torch.from_numpy(inputs).to(**to), torch.from_numpy(labels).to(**to),
                     torch.from_numpy(docs).to(**to) if self.document_mask else None,
                     int((labels != IGNORE_INDEX).sum()), first_row)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_sequences": self.n, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_sequences"] != self.n:
            raise ConfigError(f"the checkpoint's data had {state['num_sequences']} sequences, this "
                              f"run has {self.n}: resume with the same data.path and training.seq_len")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm = self._permutation()
