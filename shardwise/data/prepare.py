"""Preparation: stream each source, tokenize it on every core, write memory-mappable token shards.

A prepared source is a folder::

    manifest.json          settings (source files with sizes and mtimes, tokenizer fingerprint, split,
                           shard size), then ``complete`` and the counts once every shard is written
    shards/00000.train.bin/.idx, 00000.val.bin/.idx   Megatron indexed-dataset files (indexed.py)
    shards/00000.json      the shard's record, written last: a shard without it is not complete

Shard ``i`` holds the documents of unit ``i`` (sources.py), in order, so the shards do not depend on
the number of workers. Each document is ``[bos] + tokens + [eos]``; a document goes to the held-out
split when a hash of its text falls below ``val_fraction`` -- the split needs no count of the corpus
and a repeated document always lands on the same side.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.config.notice import say
from shardwise.config.schema import ConfigError, DataConfig
from shardwise.data.indexed import ShardWriter, token_dtype
from shardwise.data.sources import (
    DataError,
    Source,
    Unit,
    documents,
    files_of,
    is_compressed,
    plan_units,
    resolve_sources,
)
from shardwise.data.tokenizer import Tokenizer, load_tokenizer
from shardwise.runtime.hub import is_hub_id, local_model
from shardwise.runtime.machine import usable_cores

FORMAT = 1
_BATCH_CHARS = 1 << 20  # documents are tokenized ~1 MB of text at a time: a worker's memory bound


def is_validation(text: str, fraction: float) -> bool:
    """The held-out rule: a 64-bit hash of the text below ``fraction`` of the range."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h < fraction * 2.0**64


def settings(source: Source, cfg: DataConfig, tokenizer: Tokenizer, val_fraction: float) -> dict[str, Any]:
    """Everything the shards of ``source`` depend on (and nothing they do not, e.g. the workers)."""
    return {"format": FORMAT, "kind": source.kind, "text_field": source.text_field, "data_format": cfg.format,
            "txt_sample_by": cfg.txt_sample_by, "val_fraction": val_fraction,
            "shard_mb": cfg.shard_mb, "tokenizer": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id,
            "files": [{"path": str(f.resolve()), "size": f.stat().st_size,
                       "mtime_ns": f.stat().st_mtime_ns} for f in source.files]}


DataPlan = list[tuple[Source, Path, dict[str, Any]]]
"""(source, its prepared folder, its settings) for each training source, then data.val_path."""


def prepare_plan(cfg: DataConfig, tokenizer: Tokenizer) -> DataPlan:
    """The run's data plan: each source resolved to its files, its prepared folder and the settings
    its shards depend on. Worked out once per process (preflight; the run carries it) and passed to
    the functions below, which otherwise work it out themselves."""
    if cfg.synthetic:  # (nothing to prepare: the run draws its tokens)
        return []
    sources = resolve_sources(cfg)
    fraction = 0.0 if cfg.val_path else cfg.val_fraction
    out = [(s, settings(s, cfg, tokenizer, fraction)) for s in sources]
    if cfg.val_path:  # last: open_corpus holds it out
        kind, files = files_of(cfg.val_path, "data.val_path")
        if any(s.name == "val" for s in sources):
            raise ConfigError("a data source is named 'val', the name data.val_path's folder takes: "
                              "rename that source (name=...)")
        val = Source("val", cfg.val_path, 1.0, kind, cfg.text_field, files)
        out.append((val, settings(val, cfg, tokenizer, 1.0)))
    result = []
    for source, sets in out:
        if cfg.prepared_dir:
            where = Path(cfg.prepared_dir).expanduser() / source.name
        else:
            key = hashlib.sha256(json.dumps(sets, sort_keys=True).encode()).hexdigest()[:16]
            where = Path(cfg.cache_dir).expanduser() / "prepared" / f"{source.name}-{key}"
        result.append((source, where, sets))
    return result


def check_settings(where: Path, recorded: dict[str, Any], wanted: dict[str, Any]) -> None:
    """One line naming the first difference between a folder's manifest and this run's settings."""
    for key, value in wanted.items():
        if key != "files" and recorded.get(key) != value:
            raise ConfigError(f"prepared data '{where}' was made with {key}={recorded.get(key)!r}, this "
                              f"run has {value!r}: prepare into a new data.prepared_dir")
    was = {f["path"]: f for f in recorded.get("files", [])}
    for f in wanted["files"]:
        old = was.pop(f["path"], None)
        if old is None:
            raise ConfigError(f"prepared data '{where}' was made without '{f['path']}': prepare into a "
                              "new data.prepared_dir, or restore the source files it was made from")
        if (old["size"], old["mtime_ns"]) != (f["size"], f["mtime_ns"]):
            raise ConfigError(f"source file '{f['path']}' changed since '{where}' was prepared (size "
                              f"{old['size']} -> {f['size']}): prepare into a new data.prepared_dir")
    if was:
        raise ConfigError(f"prepared data '{where}' was made from '{next(iter(was))}', which data.path no "
                          "longer names: prepare into a new data.prepared_dir")


def check_prepared(cfg: DataConfig, tokenizer: Tokenizer, plan: DataPlan | None = None) -> None:
    """The sources resolve, and each folder already prepared was prepared from them as they are."""
    for _, where, sets in plan if plan is not None else prepare_plan(cfg, tokenizer):
        manifest = read_prepared(where)
        if manifest is not None:
            check_settings(where, manifest, sets)


def read_prepared(where: Path) -> dict[str, Any] | None:
    try:
        return json.loads((where / "manifest.json").read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise ConfigError(f"'{where / 'manifest.json'}' is not valid JSON: move the folder aside and "
                          "prepare again") from None


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(where: Path) -> Iterator[None]:
    """One preparer per folder (ranks of one job, or two jobs); the others wait, then find it done."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shard_done(where: Path, index: int, fingerprint: str) -> dict[str, Any] | None:
    """The record of shard ``index`` when the shard is complete as recorded, else None."""
    try:
        rec = json.loads((where / "shards" / f"{index:05d}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    for part in ("train", "val"):
        for ext, key in ((".bin", "bin_bytes"), (".idx", "idx_bytes")):
            p = where / "shards" / f"{index:05d}.{part}{ext}"
            if not p.exists() or p.stat().st_size != rec[part][key]:
                return None
        mask = where / "shards" / f"{index:05d}.{part}.mask.bin"  # (chat: one byte per token)
        if "assistant_tokens" in rec[part] and (not mask.exists()
                                                or mask.stat().st_size != rec[part]["tokens"]):
            return None
    return rec if rec.get("tokenizer") == fingerprint else None


def prepare(cfg: DataConfig, tokenizer: Tokenizer, workers: int = 0, quiet: bool = False,
            plan: DataPlan | None = None) -> list[Path]:
    """Prepare every source that is not yet (resuming one that was interrupted); the folders."""
    out = []
    for source, where, sets in plan if plan is not None else prepare_plan(cfg, tokenizer):
        with _locked(where):
            manifest = read_prepared(where)
            if manifest is not None:
                check_settings(where, manifest, sets)
            if manifest is None or not manifest.get("complete"):
                _prepare_source(source, where, sets, cfg, tokenizer, workers or cfg.workers, quiet)
        out.append(where)
    return out


def _prepare_source(source: Source, where: Path, sets: dict[str, Any], cfg: DataConfig,
                    tokenizer: Tokenizer, workers: int, quiet: bool) -> None:
    from tqdm import tqdm

    shards = where / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for junk in shards.glob(".*.tmp*"):  # an interrupted writer's partial files, never a shard
        junk.unlink()
    _write_json(where / "manifest.json", {**sets, "complete": False})
    total = sum(f.stat().st_size for f in source.files)
    if not workers:
        workers = usable_cores()
    raw = sum(f.stat().st_size * (4 if is_compressed(f) else 1) for f in source.files)
    chunk = max(1, int(cfg.shard_mb * 2**20))
    workers = max(1, min(workers, -(-raw // chunk)))  # no pool for one shard's worth
    job = dict(out=str(shards), kind=source.kind, text_field=source.text_field,
               sample_by=cfg.txt_sample_by, val_fraction=sets["val_fraction"],
               dtype=str(token_dtype(tokenizer.vocab_size)), skip_bad=cfg.skip_bad_rows,
               chat=cfg.format == "chat")
    counts = dict(docs=0, tokens=0, val_docs=0, val_tokens=0, empty=0, bad_rows=0, max_token=-1)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"prepare {source.name}", disable=quiet,
               mininterval=1.0, file=sys.stderr, dynamic_ncols=True, delay=2.0)
    start = time.perf_counter()

    def absorb(rec: dict[str, Any], nbytes: int) -> None:
        for k, v in (("docs", rec["train"]["docs"]), ("tokens", rec["train"]["tokens"]),
                     ("val_docs", rec["val"]["docs"]), ("val_tokens", rec["val"]["tokens"]),
                     ("empty", rec["empty"]), ("bad_rows", rec["bad_rows"])):
            counts[k] += v
        counts["max_token"] = max(counts["max_token"], rec["max_token"])
        for part, key in (("train", "assistant_tokens"), ("val", "val_assistant_tokens")):
            if "assistant_tokens" in rec[part]:  # chat: the tokens the loss counts
                counts[key] = counts.get(key, 0) + rec[part]["assistant_tokens"]
        for msg in rec["bad_examples"]:
            bar.write(f"skipped: {msg}")
        rate = (counts["tokens"] + counts["val_tokens"]) / max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(f"{counts['docs'] + counts['val_docs']:,} docs, {rate:,.0f} tok/s",
                            refresh=False)  # (a refresh would show the bar before its delay)
        bar.update(nbytes)

    units = enumerate(plan_units(source, cfg.txt_sample_by, chunk))
    try:
        n = _run_units(units, where, tokenizer, workers, cfg.tokenizer, job, absorb)
    finally:
        bar.close()
    _write_json(where / "manifest.json", {**sets, "complete": True, "shards": n, **counts})
    if not quiet:
        took = time.perf_counter() - start
        tokens = counts["tokens"] + counts["val_tokens"]
        say(f"prepared {source.name}: {counts['docs']:,} + {counts['val_docs']:,} held-out documents, "
            f"{tokens:,} tokens in {n} shard(s), {took:.1f} s ({tokens / max(took, 1e-9):,.0f} tok/s)"
            f"{', skipped ' + str(counts['bad_rows']) + ' bad rows' if counts['bad_rows'] else ''}"
            f" -> {where}")


class _Done:
    """A shard written in this process, read like a pool's pending result."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec

    def get(self) -> dict[str, Any]:
        return self.rec


def _run_units(units: Iterator[tuple[int, tuple[Unit, bytes | None, int]]], where: Path,
               tokenizer: Tokenizer, workers: int, spec: str, job: dict[str, Any], absorb: Any) -> int:
    """Tokenize the units not already done, on ``workers`` processes (one: in this process), at most
    two units per worker in flight -- the bytes of a compressed source's units travel with them, so
    this bounds the memory too. Returns the number of units."""
    pending: deque[tuple[Any, int]] = deque()
    n = 0
    # spawn: no fork of a process that may hold torch or tokenizer threads; a Hub id goes to the
    # workers as the snapshot this process resolved (no worker asks the Hub again)
    spec = str(local_model(spec, "data.tokenizer")) if is_hub_id(spec) else spec
    pool = mp.get_context("spawn").Pool(workers, _init_worker, (spec,)) if workers > 1 else None
    with pool or contextlib.nullcontext():
        for i, (unit, payload, nbytes) in units:
            n = i + 1
            rec = shard_done(where, i, tokenizer.fingerprint)
            if rec is not None:
                absorb(rec, nbytes)
                continue
            pending.append((pool.apply_async(_work, (i, unit, payload), job) if pool else
                            _Done(write_shard(tokenizer, i, unit, payload, **job)), nbytes))
            while len(pending) >= 2 * workers or (pending and not pool):
                res, b = pending.popleft()
                absorb(res.get(), b)
        while pending:
            res, b = pending.popleft()
            absorb(res.get(), b)
    return n


_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    os.environ["RAYON_NUM_THREADS"] = "1"
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(spec)


def _work(index: int, unit: Unit, payload: bytes | None, **job: Any) -> dict[str, Any]:
    assert _TOKENIZER is not None
    return write_shard(_TOKENIZER, index, unit, payload, **job)


def _encoded(tokenizer: Tokenizer, batch: list[Any], chat: bool) -> Iterator[tuple[str, np.ndarray,
                                                                                  np.ndarray | None]]:
    """(hash key, document tokens, loss mask or None) of each document of ``batch``: a text is
    ``[bos] + tokens + [eos]``; a conversation is what its chat template renders (the template writes
    the special tokens), with 1 on its assistant tokens."""
    if chat:  # (each conversation already rendered, as documents() read it: conv, text, spans)
        encoded = tokenizer.encode_rendered([(text, spans) for _, text, spans in batch])
        for (conv, _, _), (ids, mask) in zip(batch, encoded, strict=True):
            yield json.dumps(conv, sort_keys=True), np.asarray(ids, np.int64), np.asarray(mask, np.uint8)
        return
    for text, ids in zip(batch, tokenizer.encode_batch(batch), strict=True):
        doc = np.empty(len(ids) + 2, dtype=np.int64)
        doc[0], doc[1:-1], doc[-1] = tokenizer.bos_id, ids, tokenizer.eos_id
        yield text, doc, None


def write_shard(tokenizer: Tokenizer, index: int, unit: Unit, payload: bytes | None, *, out: str,
                kind: str, text_field: str, sample_by: str, val_fraction: float, dtype: str,
                skip_bad: bool, chat: bool = False) -> dict[str, Any]:
    """Tokenize one unit into shard ``index`` (train and held-out parts; with ``chat`` also each
    part's loss mask, ``.mask.bin/.idx``, one uint8 per token); the record, written last."""
    shards = Path(out)
    tmp = {part: shards / f".{index:05d}.{part}.tmp{os.getpid()}" for part in ("train", "val")}
    writers = {part: ShardWriter(p, np.dtype(dtype)) for part, p in tmp.items()}
    masks = ({part: ShardWriter(Path(f"{p}.mask"), np.dtype(np.uint8)) for part, p in tmp.items()}
             if chat else {})
    assistant = {"train": 0, "val": 0}  # tokens the loss counts (chat)
    bad: list[str] | None = [] if skip_bad else None
    stats = {"empty": 0, "max_token": -1}
    batch: list[Any] = []

    def flush() -> None:
        parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        mask_parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        for key, doc, mask in _encoded(tokenizer, batch, chat):
            part = "val" if is_validation(key, val_fraction) else "train"
            parts[part].append(doc)
            if mask is not None:
                mask_parts[part].append(mask)
                assistant[part] += int(mask.sum())
            stats["max_token"] = max(stats["max_token"], int(doc.max()))
        if stats["max_token"] > np.iinfo(np.dtype(dtype)).max:  # the vocabulary's size was understated
            raise DataError(f"token id {stats['max_token']} does not fit the shards' {dtype}: the "
                            "tokenizer's vocabulary is larger than it reports")
        for part, docs in parts.items():
            writers[part].add(docs)
            if chat:
                masks[part].add(mask_parts[part])
        batch.clear()

    held = 0
    render = (lambda conv: (conv, *tokenizer.render_chat(conv))) if chat else None
    for doc in documents(unit, payload, kind, text_field, sample_by, bad, chat, render):
        if not chat and not doc.strip():
            stats["empty"] += 1
            continue
        batch.append(doc)
        held += len(doc) if not chat else len(doc[1])
        if held >= _BATCH_CHARS:
            flush()
            held = 0
    if batch:
        flush()
    rec: dict[str, Any] = {"index": index, "unit": [unit.file, unit.start, unit.end],
                           "tokenizer": tokenizer.fingerprint, **stats,
                           "bad_rows": len(bad or []), "bad_examples": (bad or [])[:3]}
    for part, w in writers.items():
        rec[part] = w.close()
        exts = (".bin", ".idx")
        if chat:
            masks[part].close()
            rec[part]["assistant_tokens"] = assistant[part]
            exts += (".mask.bin", ".mask.idx")
        for ext in exts:
            os.replace(f"{tmp[part]}{ext}", shards / f"{index:05d}.{part}{ext}")
    _write_json(shards / f"{index:05d}.json", rec)
    return rec
