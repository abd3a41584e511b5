"""Finding and checking checkpoints without a process group: the manifest, file sizes and
checksums, the model a checkpoint was saved from, and what never gets loaded or deleted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from shardwise.config.model_args import TRAINING_CHOICES
from shardwise.config.notice import say
from shardwise.config.schema import ConfigError, LoRAConfig, ModelConfig
from shardwise.models import ModelArgs, model_args

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ASIDE = re.compile(r"\.(damaged|superseded)-\d{8}-\d{6}x*$")  # see set_aside()
_CHUNK = 8 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or loaded; the message names the file and the fix,
    ``reason`` says what is wrong in a few words (for a list of several checkpoints)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message



def exception_chain(e: BaseException) -> list[BaseException]:
    """``e`` and everything inside it: causes, contexts, and DCP's per-rank failures."""
    out, todo = [], [e]
    while todo:
        cur = todo.pop()
        out.append(cur)
        failures = getattr(cur, "failures", None)  # DCP's CheckpointException: rank -> (exception,
        if isinstance(failures, dict):  # traceback), or the exception itself in older versions
            for v in failures.values():
                v = v[0] if isinstance(v, tuple) and v else v
                if isinstance(v, BaseException):
                    todo.append(v)
        todo.extend(x for x in (cur.__cause__, cur.__context__) if x is not None)
    return out


def list_checkpoints(folder: Path, warn: bool = False) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``folder`` as (step, path), oldest first. With ``warn``, print
    one line for each leftover of an interrupted save or deletion (they are never loaded)."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
        elif warn and p.is_dir():
            why = ("kept aside, never loaded or deleted by shardwise: delete it when you no longer need it"
                   if _ASIDE.search(p.name) else
                   "not a complete checkpoint (an interrupted save or deletion; it is removed at the "
                   "next save)")
            say(f"warning: skipping '{p}': {why}", err=True)
    return sorted(found)


def checkpoint_or_latest(path: Path) -> Path:
    """``path`` if it is a checkpoint, else the latest one of the run directory ``path``."""
    if (path / MANIFEST).is_file():
        return path
    found = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
    if not found:
        raise CheckpointError(*_not_a_checkpoint(path))
    return found[-1][1]


def run_config(checkpoint: Path) -> Path | None:
    """The config.toml of the run that wrote ``checkpoint`` (``<run>/checkpoints/step-<N>``)."""
    for folder in (checkpoint.parent.parent, checkpoint.parent):
        if (folder / "config.toml").is_file():
            return folder / "config.toml"
    return None


def set_aside(path: Path, why: str) -> Path:
    """Rename checkpoint ``path`` to ``<name>.<why>-<time>``: out of the way of the run (never loaded,
    never swept), and nothing deleted. Returns the new path."""
    aside = path.with_name(f"{path.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "x")
    path.rename(aside)
    return aside


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of checkpoint ``path``; a one-line error if it is missing or unreadable."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist: point checkpoint.path at a "
                              "step-<N> directory")
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(*_not_a_checkpoint(path))
    try:
        manifest = json.loads(file.read_text())
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint '{path}' has an unreadable {MANIFEST} ({e}): it was "
                              "damaged; load an earlier step-<N>", f"has an unreadable {MANIFEST}") from None
    return manifest


def _not_a_checkpoint(path: Path) -> tuple[str, str]:
    """(message, reason) for a folder without a manifest: what it is instead, and the way on."""
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (f"'{path}' is a Hugging Face model folder, not a shardwise checkpoint: start from it with "
                "--checkpoint.initial_hf, or import it with shardwise convert --from-hf", "is an HF folder")
    if list_checkpoints(path / "checkpoints"):
        latest = list_checkpoints(path / "checkpoints")[-1][1]
        return (f"'{path}' is a run directory, not a checkpoint: give one of its checkpoints, e.g. "
                f"'{latest}'", "is a run directory")
    if (path / ".metadata").exists() or any(path.glob("*.distcp")) or path.name.endswith(".tmp"):
        return (f"checkpoint '{path}' is incomplete (no {MANIFEST}: its save never finished): give a "
                "complete step-<N> directory", f"is incomplete (no {MANIFEST})")
    return (f"'{path}' is neither a shardwise checkpoint (no {MANIFEST}) nor a run directory holding one: "
            "give a step-<N> directory of a run's checkpoints/", f"is not a checkpoint (no {MANIFEST})")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_files(path: Path, manifest: dict[str, Any], names: list[str] | None = None,
                checksums: bool = True) -> str | None:
    """The first problem with the files ``names`` (default all) of checkpoint ``path`` as a one-line
    message, or None."""
    why = file_problem(path, manifest, names, checksums)
    return f"checkpoint '{path}' {why}: it was damaged; load an earlier step-<N>" if why else None


def file_problem(path: Path, manifest: dict[str, Any], names: list[str] | None = None,
                 checksums: bool = True) -> str | None:
    """What is wrong with the files ``names`` (default all) of ``path``, in a few words, or None."""
    files = manifest["files"]
    for name in files if names is None else names:
        want, f = files[name], path / name
        if not f.is_file():
            return f"is missing {name}"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"is truncated or altered: {name} has {size} bytes, the manifest says {want['bytes']}"
        if checksums and sha256(f) != want["sha256"]:
            return f"is corrupt: {name} does not match its SHA-256 in {MANIFEST}"
    return None


def problem(path: Path, checksums: bool = False) -> str:
    """What keeps checkpoint ``path`` from loading, in a few words ('' if nothing; sizes only
    unless ``checksums``)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return e.reason
    return file_problem(path, manifest, checksums=checksums) or ""


def looks_intact(path: Path) -> bool:
    """Manifest readable and every file of its recorded size (no hashing)."""
    try:
        return check_files(path, read_manifest(path), checksums=False) is None
    except CheckpointError:
        return False


def verify(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file of ``path`` against its manifest in this process; return the manifest."""
    manifest = read_manifest(path)
    if problem := check_files(path, manifest, checksums=checksums):
        raise CheckpointError(problem)
    return manifest


# Model-config fields that a checkpoint does not fix: the preset's label and the training choices.
# Every other field changes what the weights compute.
TRAINING_ONLY_FIELDS = ("name", *TRAINING_CHOICES)


def check_same_function(path: Path, model_cfg: Any) -> None:
    """One-line error naming the first model-config field whose value makes this model compute a
    different function from the one checkpoint ``path`` was trained as (RoPE base and scaling,
    norm epsilon, head size, MoE scoring and routing, ...), with both values. Shapes are checked
    by :func:`check_compatible`; a manifest without a model config (an old one) is not checked."""
    manifest = read_manifest(path)
    if not isinstance(manifest.get("model"), dict):
        return
    saved = dataclasses.asdict(manifest_model_config(manifest, path))  # (a newer version's: refused)
    saved = {k: v for k, v in saved.items() if k in manifest["model"]}
    ours = dataclasses.asdict(model_cfg)
    for name, value in ours.items():
        if name in TRAINING_ONLY_FIELDS or name not in saved or saved[name] == value:
            continue
        if name == "moe_balance" and ("bias" in saved[name]) == ("bias" in value):
            continue  # an auxiliary loss shapes training only; the bias adds routing state
        if isinstance(value, float) and isinstance(saved[name], (int, float)) and float(saved[name]) == value:
            continue
        raise CheckpointError(f"checkpoint '{path}' was trained with model.{name}={saved[name]!r}, this "
                              f"run has model.{name}={value!r}: the weights would compute a different "
                              f"function; pass --model.{name}={saved[name]} (or load another checkpoint)")


def model_only(path: Path) -> bool:
    """True for a weights-only checkpoint (e.g. ``shardwise convert --from-hf``): no optimizer."""
    return is_weights_only(read_manifest(path))


def is_weights_only(manifest: dict[str, Any]) -> bool:
    return manifest.get("contents") == ["model"]


def manifest_model_config(manifest: dict[str, Any], path: Path) -> ModelConfig:
    """The ``[model]`` section checkpoint ``path``'s manifest records; one line if it has none, or
    names a field this version does not know (a checkpoint of a newer shardwise)."""
    saved = manifest.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint '{path}' records no model config in its {MANIFEST}: it was not "
                              "written by shardwise train or convert; export it from the run that made it")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown := sorted(set(saved) - known):
        # (a flipped byte in a key looks the same: both causes are named)
        raise CheckpointError(f"checkpoint '{path}' records model field(s) {', '.join(unknown)} in its "
                              f"{MANIFEST} that this shardwise does not know: saved by a newer version "
                              "(upgrade shardwise to read it), or the file was damaged or edited (load an "
                              "earlier step-<N>)")
    try:
        return ModelConfig(**saved)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}' records an unusable model config ({e}): it was damaged "
                              "or edited; load an earlier step-<N>") from None


def manifest_model(manifest: dict[str, Any], path: Path) -> ModelArgs:
    """The model a checkpoint's manifest records (its ``[model]`` section over the preset it names)."""
    try:
        return model_args(manifest_model_config(manifest, path))
    except ConfigError as e:
        raise CheckpointError(f"checkpoint '{path}': its recorded model config is refused ({e})") from None


def manifest_lora(manifest: dict[str, Any], path: Path) -> LoRAConfig | None:
    """The LoRA adapters checkpoint ``path`` holds beside its base weights (``[lora]`` of the run that
    saved it), None when it holds none."""
    saved = manifest.get("lora")
    if saved is None:
        return None
    try:
        lora = LoRAConfig(**saved)
        if not isinstance(lora.rank, int) or lora.rank < 1:
            raise ValueError(f"rank {lora.rank!r}")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}' records an unusable [lora] section ({e}): it was damaged "
                              "or edited; load an earlier step-<N>") from None
    return lora
