"""Hugging Face Hub ids wherever a model folder, a tokenizer or a dataset is accepted.

``Qwen/Qwen3-0.6B`` (``@REVISION`` optional) in ``--checkpoint.initial_hf``, ``--data.tokenizer``,
``generate --hf``, ``chat --hf``, ``convert --from-hf``, ``shardwise.load``;
``hf://datasets/ORG/NAME[/PATH]`` in ``--data.path``. An argument that names an existing file or
folder is always that; otherwise an id resolves through ``huggingface_hub``'s cache (``HF_HOME``,
``HF_HUB_CACHE``), which it fills on first use with the files a run reads and nothing else: configs,
tokenizer files and safetensors for a model (never code, never pickled weights), corpus files for a
dataset. ``HF_HUB_OFFLINE=1`` reads the cache only.

**Once per node.** The local launcher resolves the run before it starts its ranks, so the ranks
(:data:`LAUNCHED_RANK_ENV`) only read the cache. Under torchrun or Slurm, local rank 0 fetches
while the node's other ranks wait for the cache to hold the whole snapshot: ``huggingface_hub``
(1.22 or later, the lowest version this package allows) records the repository's file list in the
cache before any file and refuses a snapshot that misses one of them (``IncompleteSnapshotError``),
so a half-written snapshot is never taken for a whole one.

Every failure is one line naming its fix: a gated repository (``hf auth login``), an unknown id,
no network (``shardwise download`` on a machine that has it).
"""

from __future__ import annotations

import functools
import os
import re
import time
from pathlib import Path

from shardwise.config.notice import LAUNCHED_RANK_ENV, notice
from shardwise.config.schema import ConfigError

_ID = re.compile(r"^([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)(?:@([\w./-]+))?$")
_DATASET = re.compile(r"^hf://datasets/([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@([\w.-]+))?(?:/(.*))?$")

MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
"""What a model id fetches: what convert, generate and training from HF read (no code, no pickles)."""

DATA_SUFFIXES = [".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".txt", ".txt.gz", ".txt.zst"]
"""What a dataset id fetches: the corpus files data.path reads (not the card or its metadata)."""

WAIT_S = 6 * 3600.0
"""How long a rank waits for its node's local rank 0 to fetch a snapshot (a 405B model is ~800 GB)."""


def is_hub_id(ref: str) -> bool:
    """Whether ``ref`` (a flag's value) is a Hub model id rather than a path: ORG/NAME[@REV], and no
    file or folder of that name exists."""
    return bool(ref) and _ID.match(ref) is not None and not Path(ref).expanduser().exists()


def is_hub_dataset(ref: str) -> bool:
    return ref.startswith("hf://datasets/")


def local_model(ref: str, field: str) -> Path:
    """``ref`` as a local folder: itself when it is a path, else the Hub id's snapshot in the cache
    (fetched when missing). ``field`` names the flag in errors."""
    if not is_hub_id(ref):
        return Path(ref).expanduser()
    m = _ID.match(ref)
    assert m is not None
    return _snapshot(f"{m[1]}/{m[2]}", m[3], "model", tuple(MODEL_FILES), field)


def local_dataset(ref: str, field: str) -> Path:
    """``hf://datasets/ORG/NAME[@REV][/PATH]`` as the local file or folder of its corpus files."""
    repo, revision, inner, patterns = _dataset_parts(ref, field)
    return _inside(_snapshot(repo, revision, "dataset", patterns, field), inner, repo, field)


def _inside(folder: Path, inner: str, repo: str, field: str) -> Path:
    """``inner`` (a path in the dataset ``repo``) in its fetched ``folder``, which holds only corpus
    files: missing when the path holds none."""
    found = folder / inner if inner else folder
    if not found.exists():
        raise ConfigError(f"{field}: the dataset {repo} has no corpus files under '{inner or '/'}' (parquet, "
                          "jsonl or txt): name a folder or file of the repository")
    return found


def _dataset_parts(ref: str, field: str) -> tuple[str, str | None, str, tuple[str, ...]]:
    """(repository, revision, path inside it, the file patterns to fetch) of a dataset path."""
    m = _DATASET.match(ref)
    if m is None:
        raise ConfigError(f"{field} '{ref}' is not a Hub dataset path: write hf://datasets/ORG/NAME, "
                          "optionally @REVISION and /PATH (a folder or file in the repository)")
    inner = (m[3] or "").strip("/")
    under = f"{inner}/" if inner else ""
    patterns = (inner,) if Path(inner).suffix else tuple(f"{under}*{s}" for s in DATA_SUFFIXES)
    return m[1], m[2], inner, patterns


def download(ref: str, out: Path | None = None) -> tuple[str, Path]:
    """``shardwise download``: a model id or ``hf://datasets/...`` path fetched with what a run reads of
    it, into the cache (``out`` None: where every command then finds it) or into the folder ``out``.
    Returns (what it is, "model" or "dataset"; where it is)."""
    if is_hub_dataset(ref):
        repo, revision, inner, patterns = _dataset_parts(ref, "download")
        kind = "dataset"
    elif (m := _ID.match(ref)) is not None:
        repo, revision, inner, patterns, kind = f"{m[1]}/{m[2]}", m[3], "", MODEL_FILES, "model"
    else:
        raise ConfigError(f"download: '{ref}' is not a Hub id: give ORG/NAME[@REVISION] for a model, or "
                          "hf://datasets/ORG/NAME[@REVISION][/PATH] for a dataset")
    _check_snapshot_guard("download")
    folder = _fetch(repo, revision, kind, list(patterns), "download", local=False, local_dir=out)
    return kind, _inside(folder, inner, repo, "download") if kind == "dataset" else folder


def _check_snapshot_guard(field: str) -> None:
    """huggingface_hub older than pyproject's pin (installed past it, e.g. ``--no-deps``) would hand a
    waiting rank a half-written snapshot: refused before any fetch or wait."""
    import huggingface_hub
    from huggingface_hub import errors

    if not hasattr(errors, "IncompleteSnapshotError"):
        raise ConfigError(f"{field}: huggingface_hub {huggingface_hub.__version__} can take a half-written "
                          "snapshot for a whole one: pip install 'huggingface_hub>=1.22'")


@functools.cache
def _snapshot(repo: str, revision: str | None, kind: str, patterns: tuple[str, ...] | list[str],
              field: str) -> Path:
    """The cached snapshot folder of ``repo`` holding ``patterns`` (once per process)."""
    _check_snapshot_guard(field)
    if os.environ.get(LAUNCHED_RANK_ENV):  # the launcher fetched it before starting this rank
        return _fetch(repo, revision, kind, patterns, field, local=True)
    if os.environ.get("LOCAL_RANK", "0") != "0":  # torchrun/Slurm: local rank 0 fetches for the node
        return _wait(repo, revision, kind, patterns, field)
    return _fetch(repo, revision, kind, patterns, field, local=False)


def _wait(repo: str, revision: str | None, kind: str, patterns: list[str], field: str) -> Path:
    deadline, said = time.monotonic() + WAIT_S, False
    while True:
        try:
            return _fetch(repo, revision, kind, patterns, field, local=True)
        except ConfigError:
            if time.monotonic() > deadline:
                raise
            if not said:
                notice(f"{field}: waiting for local rank 0 to fetch {repo} into the Hugging Face cache")
                said = True
            time.sleep(2.0)


def _fetch(repo: str, revision: str | None, kind: str, patterns: list[str], field: str, local: bool,
           local_dir: Path | None = None) -> Path:
    """``snapshot_download`` (into the cache, or a plain copy in ``local_dir``) with its failures as
    one-line errors."""
    from huggingface_hub import constants, errors, snapshot_download

    offline = local or constants.HF_HUB_OFFLINE
    what = "dataset" if kind == "dataset" else "model"
    ref = f"{repo}@{revision}" if revision else repo
    try:
        return Path(snapshot_download(repo, repo_type=kind, revision=revision, allow_patterns=list(patterns),
                                      local_files_only=local, local_dir=local_dir))
    except errors.GatedRepoError:
        raise ConfigError(f"{field}: the {what} {repo} is gated: accept its terms on "
                          f"https://huggingface.co/{_page(repo, kind)}, then log in here (`hf auth login`, "
                          "or set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{field}: the {what} {repo} has no revision '{revision}'") from None
    except errors.RepositoryNotFoundError:
        example = "HuggingFaceFW/fineweb-edu" if kind == "dataset" else "Qwen/Qwen3-0.6B"
        raise ConfigError(f"{field}: {_no_folder(ref, kind, field)}the Hub has no {what} '{repo}' (or it "
                          f"is private: `hf auth login`); check the path or the exact id, e.g. {example}"
                          ) from None
    # (a half-written snapshot's IncompleteSnapshotError is a LocalEntryNotFoundError)
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        if isinstance(e.__cause__, errors.HfHubHTTPError):  # reached, but it failed (a 5xx): not ours to fix
            raise ConfigError(f"{field}: the Hub answered {_status(e.__cause__)} for '{ref}', which is not "
                              f"in the Hugging Face cache ({constants.HF_HUB_CACHE}) either: try again "
                              "later") from None
        why = ("this rank reads the cache only" if local and not constants.HF_HUB_OFFLINE else
               "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached")
        if field == "download":
            raise ConfigError(f"download: '{_spelled(repo, kind)}' cannot be fetched here ({why}): run the "
                              "download on a machine with network, with HF_HOME on storage this one "
                              "shares") from None
        raise ConfigError(f"{field}: {_no_folder(ref, kind, field)}'{ref}' is not (wholly) in the Hugging "
                          f"Face cache ({constants.HF_HUB_CACHE}) and {why}: run `shardwise download "
                          f"{_spelled(repo, kind)}` on a machine with network and the same HF_HOME, or "
                          "pass a local folder") from None
    except errors.HfHubHTTPError as e:
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{field}: the Hub answered {_status(e)} for '{ref}': {said}") from None


def _status(e: Exception) -> str:
    """An HTTP error's status code, as text."""
    response = getattr(e, "response", None)
    return str(response.status_code) if response is not None else "an error"


def _no_folder(ref: str, kind: str, field: str) -> str:
    """A model id is also a path that is not there (a mistyped folder reads as an id): say both."""
    return "" if kind == "dataset" or field == "download" else f"there is no folder '{ref}' here, and "


def _page(repo: str, kind: str) -> str:
    return f"datasets/{repo}" if kind == "dataset" else repo


def _spelled(repo: str, kind: str) -> str:
    return f"hf://datasets/{repo}" if kind == "dataset" else repo
