"""Whole documents per window: which documents each training window holds (chat data).

Pretraining text is one stream cut into contiguous windows. A conversation cut that way trains its
later turns in the next window without its system prompt or earlier turns, so chat data is packed
instead: every window holds whole conversations, back to back, and pad tokens (no loss, a document
of their own) fill the rest.

**The packing.** Documents are taken in a fixed shuffled order (seed :data:`PACK_SEED`, so the packing
is a property of the prepared data and the sequence length, shared by every run and layout) in
buffers of :data:`BUFFER` documents; within a buffer, longest first, each goes to the fullest open
window it fits (best-fit decreasing). A window holds ``seq_len + 1`` tokens (inputs and labels
shifted by one). A document longer than that is truncated to it: its tokens past the window are not
trained, and preparation says how many conversations that cut and how many assistant tokens it
dropped. (Splitting a long conversation at a turn boundary with its earlier turns repeated would
train them twice as often as the rest; truncation keeps each conversation once, and a notice names
the fix: a longer ``training.seq_len``.)

**Where it lives.** The packing is computed once per (split, sequence length) and kept beside the
prepared shards as ``packing/<split>-<seq_len>.npz`` (written to a temporary name and renamed; read
back only when its counts match the shards): ``order`` (the documents, window after window) and
``starts`` (window ``i`` holds ``order[starts[i]:starts[i + 1]]``) -- 8 bytes per document and per
window, memory-mapped by nothing: a 10M-conversation corpus holds 80 MB.
"""

from __future__ import annotations

import bisect
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PACK_SEED = 0
BUFFER = 8192
"""Documents packed together: best-fit quality grows with the buffer, and packing time with it too
(each placement searches the buffer's open windows)."""


@dataclass(frozen=True)
class Packing:
    """Documents per window, and what the packing cost."""

    order: np.ndarray  # (documents,) int64: the documents, window after window
    starts: np.ndarray  # (windows + 1,) int64
    capacity: int  # tokens per window (seq_len + 1)
    tokens: int  # document tokens kept (after truncation)
    truncated: int  # documents longer than a window

    @property
    def windows(self) -> int:
        return len(self.starts) - 1

    @property
    def efficiency(self) -> float:
        """The share of the windows' tokens that are documents, not padding."""
        return self.tokens / max(self.windows * self.capacity, 1)


def pack(lengths: np.ndarray, capacity: int, seed: int = PACK_SEED, buffer: int = BUFFER) -> Packing:
    """Best-fit decreasing packing of documents of ``lengths`` into windows of ``capacity`` tokens,
    buffer by buffer in a seeded shuffled order (the module's docstring)."""
    n = len(lengths)
    kept = np.minimum(lengths, capacity).astype(np.int64)
    shuffled = np.random.default_rng(seed).permutation(n)
    order: list[np.ndarray] = []
    sizes: list[int] = []
    for lo in range(0, n, buffer):
        docs = shuffled[lo:lo + buffer]
        docs = docs[np.argsort(-kept[docs], kind="stable")]  # longest first
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (room left, bin), sorted: the fullest that fits is found first
        for d in docs.tolist():
            need = int(kept[d])
            at = bisect.bisect_left(free, (need, -1))
            if at == len(free):
                bins.append([d])
                bisect.insort(free, (capacity - need, len(bins) - 1))
            else:
                room, b = free.pop(at)
                bins[b].append(d)
                bisect.insort(free, (room - need, b))
        order.extend(np.asarray(b, dtype=np.int64) for b in bins)
        sizes.extend(len(b) for b in bins)
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    flat = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    return Packing(flat, starts, capacity, int(kept.sum()), int((lengths > capacity).sum()))


def cached_packing(where: Path | None, name: str, lengths: np.ndarray, capacity: int) -> Packing:
    """The packing of ``lengths`` into windows of ``capacity``, read from ``where/packing/<name>-<S>.npz``
    when it is there and whole (else computed and written, atomically; every rank computes the same)."""
    path = where / "packing" / f"{name}-{capacity - 1}.npz" if where is not None else None
    if path is not None and path.exists():
        try:
            with np.load(path) as f:  # (a zip: a member that fails its CRC raises)
                got = Packing(f["order"], f["starts"], int(f["capacity"]), int(f["tokens"]),
                              int(f["truncated"]))
            if (got.capacity == capacity and len(got.order) == len(lengths) and got.starts[-1] == len(lengths)
                    and got.tokens == int(np.minimum(lengths, capacity).sum())):
                return got
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            pass  # damaged or foreign: computed again below, and replaced
    got = pack(lengths, capacity)
    if path is not None:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, order=got.order, starts=got.starts, capacity=capacity, tokens=got.tokens,
                     truncated=got.truncated)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return got
