"""Corpus sources: which files ``data.path`` / ``data.sources`` name, how they cut into units of
work, and the documents a unit holds -- all streamed, never a whole file in memory.

A *unit* is what one preparation worker tokenizes into one shard. Units are cut at fixed points
(every ``data.shard_mb`` of source text, moved forward to the next document boundary), so the
shards are the same whatever the number of workers, and an interrupted preparation can skip the
units it finished. Uncompressed files are cut by byte offsets (the worker reads its own range);
``.gz``/``.zst`` files cannot seek, so the preparing process decompresses them and hands each unit's
bytes to a worker; parquet files cut at row groups.

Documents match what HF ``datasets`` reads from the same files (tests compare the two): a .txt
paragraph is text between "\\n\\n" separators, a line is a line without its newline; rows are JSON
lines or parquet rows with ``text_field``; documents that are empty or whitespace are skipped.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shardwise.config.extras import require_extra
from shardwise.config.schema import ConfigError, DataConfig
from shardwise.data.chat import check_messages
from shardwise.data.tokenizer import SHIPPED_CHAT, SHIPPED_CORPUS
from shardwise.runtime.hub import is_hub_dataset, local_dataset

_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".zst")
_WHOLE_JSON_LIMIT = 1 << 30  # a .json holding one array is parsed whole: refuse past 1 GiB
_EMPTY = (b"\n", b"\r\n")


class DataError(ConfigError):
    """Unreadable input, named by file and row; one line."""


@dataclass(frozen=True)
class Source:
    """One corpus of a mix: its files (sorted) and how to read them."""

    name: str
    path: str
    weight: float
    kind: str  # text | json | parquet
    text_field: str
    files: tuple[Path, ...]


@dataclass(frozen=True)
class Unit:
    """A stretch of one file: bytes [start, end) of a plain file, row group ``start`` of a parquet
    file, or chunk ``start`` of a compressed stream (its bytes travel with it). ``row`` is the
    1-based line or row the unit starts at, 0 when not yet counted (byte ranges count on error).
    ``whole``: one document or one JSON array, the whole file (a .txt document, a .json array)."""

    file: str
    start: int
    end: int
    row: int = 0
    whole: bool = False


def files_of(path: str, key: str, default: Path = SHIPPED_CORPUS) -> tuple[str, tuple[Path, ...]]:
    """(kind, files) that ``path`` names (empty: ``default``); a one-line error naming ``key`` when
    unusable. ``hf://datasets/...``: the Hub dataset's corpus files in the cache (runtime/hub.py)."""
    p = local_dataset(path, key) if is_hub_dataset(path) else Path(path).expanduser() if path else default
    if not p.exists():
        raise ConfigError(f"{key} '{path}' does not exist: give a .txt/.jsonl/.json/.parquet file (or "
                          ".gz/.zst of one) or a folder of them")
    found = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    kinds = {f: _KINDS[s[-1]] for f in found
             if (s := [x for x in f.suffixes if x not in _COMPRESSED]) and s[-1] in _KINDS}
    if not kinds:
        raise ConfigError(f"{key} '{path}' holds no .txt, .jsonl, .json or .parquet files")
    if len(set(kinds.values())) > 1:
        raise ConfigError(f"{key} '{path}' mixes file kinds ({', '.join(sorted(set(kinds.values())))}):"
                          " keep one kind per folder, or make each its own data.sources entry")
    empty = [f for f in kinds if f.stat().st_size == 0]
    if empty:
        raise ConfigError(f"data file '{empty[0]}' is empty: remove it or point {key} elsewhere")
    if any(f.suffix == ".zst" for f in kinds):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise ConfigError(f"{key} '{path}' has .zst files: pip install zstandard") from None
    if "parquet" in kinds.values():
        require_extra("parquet", f"{key} '{path}' (.parquet files)")
    return next(iter(kinds.values())), tuple(kinds)


def resolve_sources(cfg: DataConfig) -> list[Source]:
    """The corpora to mix: ``data.sources`` tables, else ``data.path`` alone with weight 1."""
    field = cfg.messages_field if cfg.format == "chat" else cfg.text_field
    if not cfg.sources:
        shipped = SHIPPED_CHAT if cfg.format == "chat" else SHIPPED_CORPUS
        kind, files = files_of(cfg.path, "data.path", shipped)
        name = Path(cfg.path or shipped).name.split(".")[0]
        return [_checked(cfg, Source(name or "data", cfg.path, 1.0, kind, field, files), "data.path")]
    out: list[Source] = []
    for i, table in enumerate(cfg.sources):
        key = f"data.sources[{i}]"
        unknown = set(table) - {"path", "weight", "name", "text_field"}
        if unknown or "path" not in table:
            raise ConfigError(f"{key} takes path, weight, name and text_field; got "
                              f"{', '.join(sorted(table))}: give at least path=...")
        try:
            weight = float(table.get("weight", 1.0))
        except ValueError:
            raise ConfigError(f"{key}.weight must be a number, got {table['weight']!r}") from None
        if not weight > 0:
            raise ConfigError(f"{key}.weight must be > 0, got {weight}")
        kind, files = files_of(str(table["path"]), f"{key}.path")
        name = str(table.get("name") or Path(str(table["path"])).name.split(".")[0] or f"source{i}")
        out.append(_checked(cfg, Source(name, str(table["path"]), weight, kind,
                                        str(table.get("text_field", field)), files), f"{key}.path"))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.sources names repeat ({', '.join(names)}): give each a distinct name=")
    return out


def _checked(cfg: DataConfig, source: Source, key: str) -> Source:
    if cfg.format == "chat" and source.kind == "text":
        raise ConfigError(f"data.format=chat reads conversations from .jsonl/.json/.parquet rows; {key} "
                          f"'{source.path or SHIPPED_CORPUS}' holds text files")
    return source


def is_compressed(f: Path | str) -> bool:
    return str(f).endswith(_COMPRESSED)


def decompressed(raw: IO[bytes], name: Path | str) -> IO[bytes]:
    """A binary reader of ``raw``'s content, decompressed when ``name`` says .gz or .zst (close
    ``raw`` too: a gzip reader leaves it open)."""
    if str(name).endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if str(name).endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def open_stream(f: Path | str) -> IO[bytes]:
    """A binary reader of the file's decompressed content (closing it closes the file)."""
    if str(f).endswith(".gz"):
        return gzip.open(f, "rb")
    return decompressed(open(f, "rb"), f)  # noqa: SIM115 (the caller closes it)


def _boundary(prev: bytes | None, mid: bytes | None, line: bytes, kind: str, sample_by: str) -> bool:
    """May a unit start at ``line``, given the two lines before it? Paragraph text only after
    "non-empty, empty": there the "\\n\\n" split and a cut agree (longer runs pair up differently)."""
    if kind == "text" and sample_by == "paragraph":
        return prev not in (None, *_EMPTY) and mid in _EMPTY and line not in _EMPTY
    return kind != "text" or sample_by == "line"


def plan_units(source: Source, sample_by: str, chunk: int) -> Iterator[tuple[Unit, bytes | None, int]]:
    """(unit, its bytes when compressed else None, source bytes it covers) in a fixed order."""
    for f in source.files:
        size = f.stat().st_size
        if source.kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(f).metadata
            row = 1
            for g in range(meta.num_row_groups):
                yield Unit(str(f), g, g + 1, row), None, size // max(meta.num_row_groups, 1)
                row += meta.row_group(g).num_rows
        elif (source.kind == "text" and sample_by == "document") or _whole_json(f, source.kind):
            payload = None
            if is_compressed(f):
                with open_stream(f) as s:
                    payload = s.read()
            yield Unit(str(f), 0, size, 1, whole=True), payload, size
        elif is_compressed(f):
            yield from _cut_stream(f, source.kind, sample_by, chunk, size)
        else:
            yield from _cut_file(f, source.kind, sample_by, chunk, size)


def _whole_json(f: Path, kind: str) -> bool:
    """A .json file holding one JSON array (not JSON lines)."""
    if kind != "json" or not str(f).removesuffix(".gz").removesuffix(".zst").endswith(".json"):
        return False
    with open_stream(f) as s:
        head = s.read(4096).lstrip()
    if head[:1] != b"[":
        return False
    if f.stat().st_size > _WHOLE_JSON_LIMIT:
        raise DataError(f"data file '{f}' is one JSON array of {f.stat().st_size >> 20} MB: convert it to "
                        "JSON lines (.jsonl, one object per line) to read it streaming")
    return True


def _cut_file(f: Path, kind: str, sample_by: str, chunk: int, size: int) -> Iterator[tuple[Unit, None, int]]:
    """Byte ranges of about ``chunk`` bytes, each starting where a document may start."""
    start = 0
    with open(f, "rb") as fh:
        while start < size:
            end = _next_start(fh, start + chunk, kind, sample_by, size)
            yield Unit(str(f), start, end, 1 if start == 0 else 0), None, end - start
            start = end


def _next_start(fh: IO[bytes], at: int, kind: str, sample_by: str, size: int) -> int:
    if at >= size:
        return size
    fh.seek(at - 1)
    fh.readline()  # to the start of the next whole line
    prev = mid = None
    while True:
        pos = fh.tell()
        line = fh.readline()
        if not line:
            return size
        if _boundary(prev, mid, line, kind, sample_by):
            return pos
        prev, mid = mid, line


def _cut_stream(f: Path, kind: str, sample_by: str, chunk: int,
                size: int) -> Iterator[tuple[Unit, bytes, int]]:
    """Decompress ``f`` and cut it into units of about ``chunk`` bytes (carried with the unit)."""
    raw = open(f, "rb")  # noqa: SIM115 (closed below) -- its position measures progress
    stream = decompressed(raw, f)
    try:
        lines: list[bytes] = []
        held, row, first_row, n, done = 0, 1, 1, 0, 0
        prev = mid = None
        for line in stream:
            if held >= chunk and _boundary(prev, mid, line, kind, sample_by):
                yield Unit(str(f), n, n + 1, first_row), b"".join(lines), raw.tell() - done
                done, n, first_row, lines, held = raw.tell(), n + 1, row, [], 0
            lines.append(line)
            held += len(line)
            row += 1
            prev, mid = mid, line
        if lines:
            yield Unit(str(f), n, n + 1, first_row), b"".join(lines), size - done
    except (OSError, EOFError) as e:
        raise DataError(f"data file '{f}' could not be decompressed: {e}") from None
    finally:
        stream.close()
        raw.close()


def unit_lines(unit: Unit, payload: bytes | None) -> Iterator[bytes]:
    """The unit's lines as bytes, newline included."""
    if payload is not None:
        yield from io.BytesIO(payload)
        return
    with open(unit.file, "rb") as fh:
        fh.seek(unit.start)
        pos = unit.start
        while pos < unit.end:
            line = fh.readline()
            if not line:
                return
            pos += len(line)
            yield line


def row_number(unit: Unit, offset: int) -> int:
    """1-based line number of the unit's ``offset``-th line (counts the file up to it on demand)."""
    if unit.row:
        return unit.row + offset
    with open(unit.file, "rb") as fh:
        before = fh.read(unit.start).count(b"\n")
    return before + 1 + offset


def documents(unit: Unit, payload: bytes | None, kind: str, text_field: str, sample_by: str,
              bad: list[str] | None, chat: bool = False,
              render: Callable[[Any], Any] | None = None) -> Iterator[Any]:
    """The unit's document texts (``chat``: its conversations, each a list of messages, or what
    ``render`` makes of each). A row that cannot be read -- or that ``render`` refuses with a
    ``ValueError`` (a chat template that raises on it) -- raises ``DataError`` (file and row), or
    with ``bad`` given is skipped and described there."""
    def fail(i: int, why: str) -> None:
        msg = f"data file '{unit.file}' row {row_number(unit, i)}: {why}"
        if bad is None:
            raise DataError(f"{msg} (data.skip_bad_rows=true skips and counts such rows)")
        bad.append(msg)

    def accept(i: int, value: Any) -> Iterator[Any]:
        yield from (value,) if render is None else _rendered(i, value, render, fail)

    if kind == "parquet":
        for i, value in _parquet_docs(unit, text_field, fail, chat):
            yield from accept(i, value)
        return
    if kind == "json" and unit.whole:
        raw = payload if payload is not None else Path(unit.file).read_bytes()
        try:
            rows = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"data file '{unit.file}' is not valid JSON: {e}") from None
        for i, row in enumerate(rows):
            text, why = _field(row, text_field, chat)
            if why:
                fail(i, why)
            else:
                yield from accept(i, text)
        return
    if kind == "text" and unit.whole:
        raw = payload if payload is not None else Path(unit.file).read_bytes()
        try:
            yield raw.decode("utf-8").replace("\r\n", "\n")
        except UnicodeDecodeError as e:
            raise DataError(f"data file '{unit.file}' is not UTF-8 text: {e}") from None
        return
    buf, held = [], 0
    for i, line in enumerate(unit_lines(unit, payload)):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            fail(i, f"not UTF-8 ({e.reason} at byte {e.start})")
            continue
        if kind == "json":
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except ValueError as e:
                fail(i, f"not valid JSON ({e})")
                continue
            value, why = _field(row, text_field, chat)
            if why:
                fail(i, why)
            else:
                yield from accept(i, value)
        elif sample_by == "line":
            yield text.replace("\r\n", "\n").removesuffix("\n")
        else:  # paragraphs: split on "\n\n" as one string would, a block at a time
            buf.append(text.replace("\r\n", "\n"))
            held += len(text)
            if held > 1 << 20:
                *done, rest = "".join(buf).split("\n\n")
                yield from done
                buf, held = [rest], len(rest)
    if buf:
        yield from "".join(buf).split("\n\n")


def _field(row: Any, text_field: str, chat: bool = False) -> tuple[Any, str]:
    """(``row[text_field]``, "") when it is a string (``chat``: a conversation), else ("", why not)."""
    if not isinstance(row, dict):
        return "", f"a JSON {type(row).__name__}, not an object"
    if text_field not in row:
        return "", (f"no '{text_field}' field (fields: {', '.join(list(row)[:8])}; set data.text_field "
                    "or the source's text_field)")
    value = row[text_field]
    if chat:
        why = check_messages(value)
        return (value, "") if not why else ("", f"'{text_field}' is {why}")
    if isinstance(value, str):
        return value, ""
    return "", f"'{text_field}' is {type(value).__name__}, not a string"


def _rendered(i: int, value: Any, render: Callable[[Any], Any], fail: Callable[[int, str], None]
              ) -> Iterator[Any]:
    """``render(value)``, or nothing with row ``i`` reported to ``fail`` when it refuses the row."""
    try:
        done = render(value)
    except ConfigError:  # (a problem of the whole template, or the data: not of this row)
        raise
    except ValueError as e:
        fail(i, str(e))
        return
    yield done


def _parquet_docs(unit: Unit, text_field: str, fail: Any, chat: bool = False) -> Iterator[tuple[int, Any]]:
    """(row index in the unit, value) of each readable row of a parquet unit."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(unit.file)
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"data file '{unit.file}' has no column '{text_field}' (columns: "
                        f"{', '.join(pf.schema_arrow.names[:8])}): set data.text_field")
    i = 0
    for batch in pf.iter_batches(batch_size=4096, row_groups=[unit.start], columns=[text_field]):
        for value in batch.column(0).to_pylist():
            why = (check_messages(value) if chat else
                   "" if isinstance(value, str) else f"{type(value).__name__}, not a string")
            if why:
                fail(i, f"'{text_field}' is {why}")
            else:
                yield i, value
            i += 1
