"""Packed causal-LM data: documents -> windows of ``S + 1`` tokens (inputs and labels shifted by one).

Text (pretraining): each document is ``[bos] + tokens + [eos]`` and a source's documents are
concatenated (across its prepared shards, in order) into one stream; window ``i`` is
``stream[i*S : i*S + S + 1]``. Chat: each window holds whole conversations, packed by
:mod:`shardwise.data.packing`, the rest padding that carries no loss (:class:`DocumentStream`). Either
way a label that belongs to a different document than its input is ignored: nothing in one document
predicts the start of the next.

Order is layout-independent: the run's global sequence ``g`` comes from the source a deterministic
weighted schedule picks for it (one source: always that one), and that source's ``k``-th sequence is
entry ``k mod n`` of a seeded permutation for epoch ``k // n``. Step ``t`` consumes global sequences
``t*G .. (t+1)*G``; data-parallel rank ``r`` takes the r-th contiguous slice of those ``G`` and splits
it into micro-batches. Any (dp, micro-batch) split of the same global batch sees the same tokens,
which is what lets every layout reproduce the single-device run. The loader's state is one count per
source, so resume is exact.

Memory: the shards are memory-mapped (a rank holds the pages it reads); what a rank holds for itself
is each source's current permutation, 8 bytes per sequence of that source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from shardwise.config.schema import ConfigError, DataConfig
from shardwise.data.indexed import Shard, ShardError
from shardwise.data.packing import Packing, cached_packing
from shardwise.data.prepare import DataPlan, prepare_plan, read_prepared, shard_done
from shardwise.data.prepare import prepare as run_prepare
from shardwise.data.tokenizer import Tokenizer

IGNORE_INDEX = -100


class Stream(Protocol):
    """A source's token stream as the loader reads it."""

    def num_windows(self, seq_len: int) -> int: ...

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def _window(toks: np.ndarray, docs: np.ndarray, mask: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, labels, doc ids from 0) of a window's S + 1 tokens and their documents; with a loss
    ``mask`` (chat: 1 on assistant tokens) a label the mask leaves out is ignored too."""
    toks = toks.astype(np.int64)
    labels = toks[1:].copy()
    labels[docs[1:] != docs[:-1]] = IGNORE_INDEX  # next token starts another document
    if mask is not None:
        labels[mask[1:] == 0] = IGNORE_INDEX  # a prompt token: not predicted, not counted
    return toks[:-1], labels, (docs[:-1] - docs[0]).astype(np.int32)


@dataclass
class TokenStream:
    """An in-memory stream: ``tokens[i]`` and the index of the document it came from."""

    tokens: np.ndarray  # (N,) int
    doc_ids: np.ndarray  # (N,) int

    def num_windows(self, seq_len: int) -> int:
        return max(0, (len(self.tokens) - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, doc_ids) of window ``i``, each (seq_len,)."""
        lo, hi = i * seq_len, i * seq_len + seq_len + 1
        return _window(self.tokens[lo:hi], self.doc_ids[lo:hi])


class ShardStream:
    """The memory-mapped shards of one split of one prepared source, read as one stream."""

    def __init__(self, prefixes: list[Path]) -> None:
        kept = [(p, s) for p, s in ((p, Shard(p)) for p in prefixes) if s.n_tokens]
        self.shards = [s for _, s in kept]
        # Chat shards carry a loss mask, one byte per token, in a shard of its own beside them.
        masked = [Path(f"{p}.mask.idx").exists() for p, _ in kept]
        self.masks = [Shard(Path(f"{p}.mask")) for p, _ in kept] if any(masked) else None
        if self.masks is not None and (not all(masked) or any(
                m.n_tokens != s.n_tokens for m, s in zip(self.masks, self.shards, strict=True))):
            raise ShardError(f"the loss masks of '{prefixes[0].parent}' do not match its shards: prepare "
                             "it again")
        sizes = [s.n_tokens for s in self.shards]
        self._first = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (n_shards + 1,)
        docs = [s.n_docs for s in self.shards]
        self._first_doc = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)])
        self.n_tokens = int(self._first[-1])

    def num_windows(self, seq_len: int) -> int:
        return max(0, (self.n_tokens - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = i * seq_len, i * seq_len + seq_len + 1
        toks, docs, masks = [], [], []
        k = int(np.searchsorted(self._first, lo, side="right")) - 1
        while lo < hi:  # a window may span the end of one shard and the start of the next
            shard, base = self.shards[k], int(self._first[k])
            a, b = lo - base, min(hi, int(self._first[k + 1])) - base
            toks.append(shard.tokens[a:b])
            docs.append(shard.doc_of(np.arange(a, b)) + self._first_doc[k])
            if self.masks is not None:
                masks.append(self.masks[k].tokens[a:b])
            lo, k = base + b, k + 1
        return _window(np.concatenate(toks), np.concatenate(docs), np.concatenate(masks) if masks else None)

    def max_token(self) -> int:
        return max((s.max_token() for s in self.shards), default=-1)

    def doc_lengths(self) -> np.ndarray:
        """Every document's length, in order across the shards: (documents,) int64."""
        parts = [np.asarray(s.lengths, dtype=np.int64) for s in self.shards]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def document(self, g: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document ``g``'s tokens and (chat) loss mask."""
        k = int(np.searchsorted(self._first_doc, g, side="right")) - 1
        local = g - int(self._first_doc[k])
        mask = self.masks[k].document(local) if self.masks is not None else None
        return self.shards[k].document(local), mask


class DocumentStream:
    """A prepared split read as whole documents per window (chat data): window ``i`` holds the
    documents :mod:`shardwise.data.packing` gives it, each truncated to the window, then pad tokens
    (id 0, a document of their own, no loss)."""

    def __init__(self, base: ShardStream, where: Path | None, split: str) -> None:
        self.base, self.where, self.split = base, where, split
        self._packings: dict[int, Packing] = {}

    def packing(self, seq_len: int) -> Packing:
        if seq_len not in self._packings:
            self._packings[seq_len] = cached_packing(self.where, self.split, self.base.doc_lengths(),
                                                     seq_len + 1)
        return self._packings[seq_len]

    def num_windows(self, seq_len: int) -> int:
        return self.packing(seq_len).windows

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = self.packing(seq_len)
        toks, docs, masks = [], [], []
        for j, d in enumerate(p.order[p.starts[i]:p.starts[i + 1]].tolist()):
            t, m = self.base.document(d)
            t = t[:p.capacity]
            toks.append(t)
            docs.append(np.full(len(t), j, dtype=np.int64))
            masks.append(m[:p.capacity] if m is not None else np.ones(len(t), dtype=np.uint8))
        pad = p.capacity - sum(len(t) for t in toks)
        toks.append(np.zeros(pad, dtype=np.int64))
        docs.append(np.full(pad, len(toks) - 1, dtype=np.int64))
        masks.append(np.zeros(pad, dtype=np.uint8))
        return _window(np.concatenate(toks), np.concatenate(docs), np.concatenate(masks))

    def truncated_loss_tokens(self, seq_len: int) -> int:
        """Loss-carrying (assistant) tokens past the window in the documents truncated to it."""
        p = self.packing(seq_len)
        long = np.flatnonzero(self.base.doc_lengths() > p.capacity)
        total = 0
        for d in long.tolist():
            t, m = self.base.document(d)
            total += int(m[p.capacity:].sum()) if m is not None else len(t) - p.capacity
        return total

    def max_token(self) -> int:
        return self.base.max_token()


SYNTHETIC_WINDOWS = (1 << 20, 1 << 14)
"""data.synthetic's training and held-out windows per epoch (a loader keeps 8 bytes per window)."""


@dataclass(frozen=True)
class SyntheticStream:
    """data.synthetic: window ``i`` is S + 1 token ids drawn uniformly from ``[0, vocab_size)`` by a
    generator seeded with (seed, split, i, S), cut into documents whose lengths are geometric with a
    mean of half a window (so document masks and cross-document labels are exercised at any S). It
    reads no file: a window is the same in every run of the seed, on every rank and every layout."""

    vocab_size: int
    seed: int
    split: int  # 0: training, 1: held out

    def num_windows(self, seq_len: int) -> int:
        return SYNTHETIC_WINDOWS[self.split]

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.split, i, seq_len])
        toks = rng.integers(0, self.vocab_size, seq_len + 1)  # (S + 1,)
        starts = rng.random(seq_len + 1) < 2 / max(seq_len, 2)  # a token that begins a new document
        return _window(toks, np.cumsum(starts))

    def max_token(self) -> int:
        return self.vocab_size - 1


def synthetic_corpus(vocab_size: int, seed: int) -> Corpus:
    """data.synthetic's corpus: one source, "synthetic", and its held-out stream."""
    train, val = (SyntheticStream(vocab_size, seed, split) for split in (0, 1))
    return Corpus(["synthetic"], [1.0], [train], [val], [1.0], vocab_size - 1)


def packing_notices(corpus: Corpus, seq_len: int) -> list[str]:
    """What whole-document packing did to each training source at this sequence length: one line of
    counts and efficiency, and a notice where conversations are longer than a window."""
    lines = []
    for name, stream in zip(corpus.names, corpus.train, strict=True):
        if not isinstance(stream, DocumentStream):
            continue
        p = stream.packing(seq_len)
        lines.append(f"data '{name}': {len(p.order):,} conversations packed whole into {p.windows:,} "
                     f"windows of {seq_len} tokens: packing efficiency {100 * p.efficiency:.1f}% (the "
                     "rest is padding without loss)")
        if p.truncated:
            lines.append(f"notice: data '{name}': {p.truncated:,} conversations are longer than "
                         f"training.seq_len + 1 = {p.capacity} tokens and are truncated to it "
                         f"({stream.truncated_loss_tokens(seq_len):,} assistant tokens past the cut are "
                         "not trained): raise training.seq_len to keep them whole")
    return lines


def epochs_to_steps(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, global_batch: int,
                    epochs: float) -> tuple[int, int]:
    """(optimizer steps, training windows) for ``epochs`` passes over the prepared training windows
    of every source together (preparing what is not yet)."""
    corpus = open_corpus(cfg, tokenizer)
    windows = sum(s.num_windows(seq_len) for s in corpus.train)
    return max(1, math.ceil(epochs * windows / global_batch)), windows


def pack_prepared(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, plan: DataPlan | None = None
                  ) -> list[str]:
    """Chat data: compute and keep each prepared split's packing at ``seq_len`` (once, before any
    rank reads it) and return :func:`packing_notices`; nothing for text data."""
    if cfg.format != "chat":
        return []
    corpus = open_corpus(cfg, tokenizer, prepare=False, plan=plan)
    for stream in [*corpus.train, *corpus.val]:
        stream.num_windows(seq_len)
    return packing_notices(corpus, seq_len)


def check_vocab(max_token: int, vocab_size: int) -> None:
    if max_token >= vocab_size:
        raise ConfigError(f"token id {max_token} in the data is beyond model.vocab_size={vocab_size}: "
                          "raise model.vocab_size to at least the tokenizer's vocabulary")


@dataclass
class Corpus:
    """What training reads: each source's train and held-out streams, its name and weight."""

    names: list[str]
    weights: list[float]
    train: list[Stream]
    val: list[Stream]
    val_weights: list[float]
    max_token: int


def refuse_synthetic(cfg: DataConfig) -> None:
    """data.synthetic has no corpus: what prepares, shows or scores one refuses it in one line."""
    if cfg.synthetic:
        raise ConfigError("data.synthetic=true draws random token ids as the run goes: there is no "
                          "corpus to prepare, show or score; give data.path instead")


def open_corpus(cfg: DataConfig, tokenizer: Tokenizer, prepare: bool = True, plan: DataPlan | None = None
                ) -> Corpus:
    """Prepare what is not yet (one process per folder does it; the others wait) and memory-map it
    (``plan``: the run's :func:`prepare_plan`, when it has one)."""
    refuse_synthetic(cfg)  # (a run draws its tokens: trainer.session.open_run_corpus)
    plan = plan if plan is not None else prepare_plan(cfg, tokenizer)
    if prepare:
        run_prepare(cfg, tokenizer, plan=plan)
    entries, top = [], -1
    for source, where, _ in plan:
        manifest = read_prepared(where)
        if not manifest or not manifest.get("complete"):
            raise ConfigError(f"'{where}' is not fully prepared: run `shardwise prepare` with this config")
        for i in range(manifest["shards"]):
            if shard_done(where, i, tokenizer.fingerprint) is None:
                raise ConfigError(f"prepared shard '{where / 'shards' / f'{i:05d}'}' is truncated, "
                                  "missing or from another tokenizer: run `shardwise prepare` with "
                                  "this config (it rewrites that shard)")
        try:
            streams: list[Stream] = [
                ShardStream([where / "shards" / f"{i:05d}.{part}" for i in range(manifest["shards"])])
                for part in ("train", "val")]
        except ShardError as e:
            raise ConfigError(f"prepared data: {e}: run `shardwise prepare` with this config") from None
        if cfg.format == "chat":  # whole conversations per window
            streams = [DocumentStream(st, where, part) for st, part in zip(streams, ("train", "val"),
                                                                         strict=True)]
        entries.append((source, *streams))
        top = max(top, int(manifest["max_token"]))
    # prepare_plan() lists data.val_path last: then it alone is held out, and the sources only train.
    sources = entries[:-1] if cfg.val_path else entries
    held_out = entries[-1:] if cfg.val_path else entries
    return Corpus([s.name for s, _, _ in sources], [s.weight for s, _, _ in sources],
                  [t for _, t, _ in sources], [v for _, _, v in held_out],
                  [s.weight for s, _, _ in held_out], top)


@dataclass
class Batch:
    """One micro-batch on one rank. ``n_valid`` counts labels that are not ``IGNORE_INDEX``."""

    inputs: torch.Tensor  # (B, S) int64
    labels: torch.Tensor  # (B, S) int64
    doc_ids: torch.Tensor | None  # (B, S) int32 when document masking is on
    n_valid: int  # (simulated ranks, verify --ranks: a tensor of each rank's count)
    first_row: int = 0  # the global batch's sequence this micro-batch starts at (all ranks counted)


class PackedLoader:
    """Stateful, deterministic loader of this rank's micro-batches for each optimizer step, from one
    stream or a weighted mix of several."""

    def __init__(self, streams: Stream | list[Stream], seq_len: int, global_batch: int,
                 micro_batch: int, dp_rank: int, dp_size: int, seed: int, document_mask: bool,
                 device: torch.device | str = "cpu", shuffle: bool = True,
                 weights: list[float] | None = None, names: list[str] | None = None) -> None:
        self.streams = list(streams) if isinstance(streams, list) else [streams]
        self.names = names or [f"source{j}" for j in range(len(self.streams))]
        w = np.asarray(weights or [1.0] * len(self.streams), dtype=np.float64)
        self.weights = w / w.sum()
        self.seq_len, self.global_batch = seq_len, global_batch
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.seed, self.document_mask, self.device, self.shuffle = seed, document_mask, device, shuffle
        self.n = [s.num_windows(seq_len) for s in self.streams]
        for name, n in zip(self.names, self.n, strict=True):
            if n == 0:
                raise ConfigError(f"data source '{name}' has no sequence of {seq_len} tokens: give it "
                                  "more text or shorten training.seq_len")
        if len(self.streams) == 1 and self.n[0] < global_batch:
            raise ConfigError(f"the data has {self.n[0]} sequences of {seq_len} tokens, fewer than "
                              f"training.global_batch={global_batch}: use more data or shorter "
                              "sequences")
        self.consumed = [0] * len(self.streams)  # sequences taken from each source so far
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.last_rows: list[tuple[int, int]] = []  # (source, window) of the last step's global batch

    def _permutation(self, j: int, epoch: int) -> np.ndarray:
        if (j, epoch) not in self._perms:
            # Counts only grow: an older epoch of this source is never read again.
            self._perms = {k: v for k, v in self._perms.items() if k[0] != j or k[1] > epoch}
            n = self.n[j]
            self._perms[j, epoch] = (np.random.default_rng([self.seed, j, epoch]).permutation(n)
                                     if self.shuffle else np.arange(n))
        return self._perms[j, epoch]

    def _schedule(self) -> list[tuple[int, int]]:
        """(source, sequence) of each of the next global batch's rows; advances the counts. Each row
        goes to the source furthest behind its weight (ties to the first): the mix is exact at every
        prefix to within one sequence per source, with no random draw to replay on resume."""
        rows = []
        for _ in range(self.global_batch):
            total = sum(self.consumed) + 1
            j = int(np.argmax(self.weights * total - np.asarray(self.consumed)))
            k = self.consumed[j]
            rows.append((j, int(self._permutation(j, k // self.n[j])[k % self.n[j]])))
            self.consumed[j] += 1
        return rows

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step (epochs roll over per source)."""
        step = self.last_rows = self._schedule()
        per_rank = self.global_batch // self.dp_size
        first = self.dp_rank * per_rank
        mine = step[first: first + per_rank]
        return [self._batch(mine[i: i + self.micro_batch], first + i)
                for i in range(0, per_rank, self.micro_batch)]

    def _batch(self, rows: list[tuple[int, int]], first_row: int) -> Batch:
        parts = [self.streams[j].window(i, self.seq_len) for j, i in rows]
        inputs, labels, docs = (np.stack(p) for p in zip(*parts, strict=True))
        to = dict(device=self.device, non_blocking=True)
        return Batch(torch.from_numpy(inputs).to(**to), torch.from_numpy(labels).to(**to),
                     torch.from_numpy(docs).to(**to) if self.document_mask else None,
                     int((labels != IGNORE_INDEX).sum()), first_row)

    def last_windows(self) -> list[str]:
        """The last step's global batch as ``source:window`` (every rank's rows, in order): what
        ``shardwise prepare --show-window`` shows."""
        return [f"{self.names[j]}:{i}" for j, i in self.last_rows]

    def mix_metrics(self) -> dict[str, float]:
        """Each source's share of the training tokens so far and its epoch (a mix only)."""
        if len(self.streams) == 1:
            return {}
        total = max(sum(self.consumed), 1)
        out: dict[str, float] = {}
        for name, c, n in zip(self.names, self.consumed, self.n, strict=True):
            out[f"data/{name}_share"] = c / total
            out[f"data/{name}_epoch"] = c / n
        return out

    def state_dict(self) -> dict[str, object]:
        return {"consumed": list(self.consumed), "seed": self.seed, "names": list(self.names),
                "num_sequences": list(self.n), "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if "consumed" not in state or list(state["names"]) != self.names:
            raise ConfigError(f"the checkpoint's data sources were {list(state.get('names', ['?']))}, "
                              f"this run has {self.names}: resume with the same data settings")
        if list(state["num_sequences"]) != self.n:
            raise ConfigError(f"the checkpoint's data had {list(state['num_sequences'])} sequences, this "
                              f"run has {self.n}: resume with the same data.path and training.seq_len")
        self.consumed = [int(c) for c in state["consumed"]]
        self._perms = {}


def show_window(corpus: Corpus, tokenizer: Tokenizer, seq_len: int, spec: str) -> str:
    """The text of training window ``spec`` (``SOURCE:INDEX``, as a spike's notice names it) at
    ``seq_len`` tokens: a header line, then its tokens decoded (labels left out of the loss count)."""
    name, _, index = spec.rpartition(":")
    if name not in corpus.names or not index.isdigit():
        raise ConfigError(f"--show-window '{spec}': give SOURCE:INDEX with SOURCE one of {corpus.names} "
                          "(the spike notice's names)")
    stream = corpus.train[corpus.names.index(name)]
    i, n = int(index), stream.num_windows(seq_len)
    if i >= n:
        raise ConfigError(f"--show-window '{spec}': source '{name}' has {n} training windows of {seq_len} "
                          f"tokens (0..{n - 1}); pass the run's --training.seq_len")
    inputs, labels, docs = stream.window(i, seq_len)
    ignored = int((labels == IGNORE_INDEX).sum())
    head = (f"{name}:{i}: {seq_len} tokens from {int(docs.max()) + 1} document(s), {ignored} of its labels "
            "out of the loss")
    return head + "\n" + tokenizer.decode([int(t) for t in inputs])
