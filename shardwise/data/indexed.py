"""Token shards in Megatron-Core's indexed-dataset format: a ``.bin`` of token ids and an ``.idx``.

We write the layout Megatron's ``preprocess_data.py`` writes (and its ``IndexedDataset`` reads),
one sequence per document, so a corpus prepared here loads in Megatron and the other way round:

    .idx: b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count u64 |
          document count u64 | lengths i32[n] | byte pointers i64[n] | document indices i64[n + 1]
    .bin: the token ids of every sequence back to back, in the narrowest dtype the vocabulary allows

Both files are memory-mapped on read: a reader's resident memory is the pages it touches, never the
shard.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
_PREFIX = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequence count, document count
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
               np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.uint16): 8}
_CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}


class ShardError(ValueError):
    """A shard that cannot be read as written (truncated, foreign, or not a shard at all)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest integer type that holds every id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def index_bytes(n_docs: int) -> int:
    """Size of the .idx file of a shard of ``n_docs`` documents."""
    return _PREFIX.size + n_docs * (4 + 8) + (n_docs + 1) * 8


class ShardWriter:
    """Appends documents to ``<prefix>.bin`` and writes ``<prefix>.idx`` on ``close()``.

    Only the lengths (4 bytes per document) are held in memory; tokens go to disk as they come.
    """

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._bin = open(f"{prefix}.bin", "wb")  # noqa: SIM115 (closed in close())
        self._lengths = array("i")  # 4 bytes per document, the only per-document state
        self.tokens = 0

    def add(self, docs: list[np.ndarray]) -> None:
        """Append documents, each a 1-D array of ids that already fits ``dtype``."""
        if not docs:
            return
        self._bin.write(np.concatenate(docs).astype(self.dtype, copy=False).tobytes())
        lengths = [len(d) for d in docs]
        self._lengths.extend(lengths)
        self.tokens += sum(lengths)

    def close(self) -> dict[str, int]:
        """Flush both files to disk; the shard's documents, tokens and file sizes."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:], dtype=np.int64)
        pointers *= self.dtype.itemsize
        with open(f"{self.prefix}.idx", "wb") as f:
            f.write(_PREFIX.pack(HEADER, 1, DTYPE_CODES[self.dtype], len(lengths), len(lengths) + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        return {"docs": len(lengths), "tokens": self.tokens, "bin_bytes": self.tokens * self.dtype.itemsize,
                "idx_bytes": index_bytes(len(lengths))}


class Shard:
    """One memory-mapped shard: ``tokens`` (N,) and each document's first token ``starts`` (D,)."""

    def __init__(self, prefix: Path) -> None:
        idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        size = idx.stat().st_size if idx.exists() else -1
        if size < _PREFIX.size:
            raise ShardError(f"'{idx}' is missing or shorter than an index header")
        with open(idx, "rb") as f:
            header, version, code, n_seq, n_doc = _PREFIX.unpack(f.read(_PREFIX.size))
        if header != HEADER or version != 1 or code not in _CODE_DTYPES:
            raise ShardError(f"'{idx}' is not a Megatron indexed-dataset index (header {header!r})")
        if size != _PREFIX.size + n_seq * 12 + n_doc * 8:
            raise ShardError(f"'{idx}' is truncated or padded: {size} bytes, its header says "
                             f"{_PREFIX.size + n_seq * 12 + n_doc * 8}")
        self.dtype = _CODE_DTYPES[code]
        self.n_docs = n_seq
        idx_map = np.memmap(idx, dtype=np.uint8, mode="r")
        self._lengths = idx_map[_PREFIX.size:_PREFIX.size + 4 * n_seq].view(np.int32)
        # Byte pointers into .bin; a document's first token is pointer / itemsize.
        self._pointers = idx_map[_PREFIX.size + 4 * n_seq:_PREFIX.size + 12 * n_seq].view(np.int64)
        self.n_tokens = 0  # the last document's start plus its length
        if n_seq:
            self.n_tokens = int(self._pointers[-1]) // self.dtype.itemsize + int(self._lengths[-1])
        want = self.n_tokens * self.dtype.itemsize
        have = bin_.stat().st_size if bin_.exists() else -1
        if have != want:
            raise ShardError(f"'{bin_}' holds {max(have, 0)} bytes, its index says {want}: truncated or "
                             "from another preparation")
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r") if want else np.zeros(0, self.dtype)

    @property
    def lengths(self) -> np.ndarray:
        """Each document's length in tokens, (D,) int32 (memory-mapped)."""
        return self._lengths

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        """The document index of each token position (binary search on the index: no copy)."""
        return np.searchsorted(self._pointers, positions * self.dtype.itemsize, side="right") - 1

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i``."""
        start = int(self._pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self._lengths[i])]

    def max_token(self) -> int:
        return int(self.tokens.max()) if self.n_tokens else -1
