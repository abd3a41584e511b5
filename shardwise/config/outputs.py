"""What shardwise writes where a user keeps files: never over them unasked, never half-written.

Two rules, one per kind of place:

- **A path the user names** (``convert --out``, ``plan --out``, ``report --out``, ``estimate
  --json``): :func:`target` checks it before any work -- an existing non-empty file or folder is
  refused in one line unless the command's ``--overwrite`` was given (a *default* path that exists
  is kept aside as ``<name>.<its time>`` with a notice instead, so the obvious command works twice).
  The output is then written into a staging path beside it and renamed into place: a failure
  leaves the target as it was, and the staging path (ours, uniquely named) is removed.
- **A run directory**: :class:`RunRecord` (``run.dir/.shardwise-record``) lists what the runs
  there wrote -- files, folders they made wholly (a checkpoint, an export, a tool's log folder) and
  folders they made to hold those -- so ``run.overwrite`` removes exactly those and nothing a user
  put beside or inside them. Paths are relative and confined: nothing in the record leads out of
  the folder, and no link is followed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardwise.config.notice import say
from shardwise.config.types import ConfigError

RECORD_NAME = ".shardwise-record"
# kinds of recorded path: "file"; "tree" (a folder the run wrote wholly: removed with its contents);
# "dir" (a folder the run made to hold its outputs: removed only once empty)
KINDS = ("file", "tree", "dir")


def aside_name(path: Path) -> Path:
    """``path`` renamed by its modification time (``plan.20261128-140312.toml``), unused."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.lstat().st_mtime))
    stem, suffix = (path.stem, path.suffix) if path.is_file() else (path.name, "")
    aside = path.with_name(f"{stem}.{stamp}{suffix}")
    while aside.exists() or aside.is_symlink():
        aside = aside.with_name(f"{aside.stem}x{aside.suffix}")
    return aside


def umask() -> int:
    """This process's umask (mkstemp/mkdtemp make owner-only paths; the output gets the usual mode)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _holds_something(path: Path) -> bool:
    if path.is_symlink() or path.is_file():
        return True
    return path.is_dir() and any(path.iterdir())


@dataclass(frozen=True)
class Target:
    """A checked output path (:func:`target`); write it with :meth:`write` or :meth:`staging`."""

    path: Path
    replace: bool  # something is there, and the user asked to overwrite it
    aside: bool  # something is there at a default path: it is renamed out of the way first

    def _commit(self, staged: Path) -> str:
        """Move ``staged`` into place; returns a notice ('' = none)."""
        said, old = "", None
        if self.path.exists() or self.path.is_symlink():
            if self.aside:
                kept = aside_name(self.path)
                self.path.rename(kept)
                said = f"the earlier {self.path} is kept as {kept}"
            elif self.replace or not _holds_something(self.path):
                old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".old",
                                            dir=self.path.parent))
                self.path.rename(old / "x")  # out of the way in one step, removed once the new one is in
            else:  # appeared since the check: never replaced unasked
                raise ConfigError(f"'{self.path}' appeared while this command ran: it is kept; the output "
                                  f"is left at '{staged}'")
        staged.rename(self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return said

    def _parents(self) -> list[Path]:
        """Make the target's missing parent folders; returns those it made, outermost first."""
        made = [p for p in reversed(self.path.absolute().parents) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return made

    def write(self, data: str | bytes) -> str:
        """Write a file: staged beside the target, fsynced, renamed. Returns a notice ('' = none)."""
        made = self._parents()
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644 & ~umask())
            return self._commit(Path(tmp))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            _remove_empty(made)
            raise

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A folder to fill; renamed onto the target when the block ends without error (a kept-aside
        earlier one is said as a notice), removed (only it, and the parent folders made for it: they are
        ours) when the block raises."""
        made = self._parents()
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent))
        try:
            yield tmp
            os.chmod(tmp, 0o755 & ~umask())
            if said := self._commit(tmp):
                say(f"notice: {said}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_empty(made)
            raise


def _remove_empty(made: list[Path]) -> None:
    """The folders a failed write made for its target (outermost first), innermost first, each only
    while empty: something another process put there since is kept."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return


def check_folder(path: str | Path, flag: str) -> None:
    """Folder ``path`` (given with ``flag``) can be a folder: neither it nor one above it is an
    existing file (creating nothing)."""
    p = Path(path).expanduser().absolute()
    if blocker := next((q for q in (p, *p.parents) if q.exists() and not q.is_dir()), None):
        raise ConfigError(f"{flag} '{path}': '{blocker}' is a file, not a folder: choose another {flag}")


def target(path: str | Path, flag: str, overwrite: bool = False, default: bool = False,
           folder: bool = True, example: str = "out.json") -> Target:
    """Check output ``path`` (given with ``flag``) before any work, creating nothing: its nearest
    existing parent must be a writable folder (the missing ones are made when it is written), and
    an existing non-empty file or folder is refused unless ``overwrite`` -- or kept aside at
    commit when ``default`` (the user did not name it). ``folder=False``: the output is a file,
    and an existing folder there (empty or not) is refused."""
    path = Path(path)
    parent = path.absolute().parent
    check_folder(parent, flag)
    blocker = next(p for p in (parent, *parent.parents) if p.exists())
    if not os.access(blocker, os.W_OK):
        raise ConfigError(f"{flag} '{path}': '{blocker}' is not writable: choose another {flag}")
    if not folder and path.is_dir():
        raise ConfigError(f"{flag} '{path}' is a folder: name a file (e.g. '{path / example}')")
    there = _holds_something(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ConfigError(f"{flag} '{path}' is not a regular file or folder: choose another {flag}")
    if there and not (overwrite or default):
        what = "folder holds files" if path.is_dir() and not path.is_symlink() else "file exists"
        raise ConfigError(f"{flag} '{path}': the {what}: pass --overwrite to replace it, or choose another "
                          f"{flag}")
    return Target(path, replace=there and overwrite, aside=there and default and not overwrite)


class RunRecord:
    """``run.dir/.shardwise-record``: one JSON line per path a run wrote there, relative to run.dir.

    Written by rank 0 only. A path is recorded when the run is about to create it (:meth:`note`);
    a path that was already there and not recorded is not the run's, and stays unrecorded."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RECORD_NAME

    def exists(self) -> bool:
        return self.path.is_file()

    def entries(self) -> dict[str, str]:
        """Recorded path -> kind, in the order first recorded (a damaged line is skipped: the record
        only ever grants removal, so losing a line keeps a file rather than losing one)."""
        out: dict[str, str] = {}
        try:
            lines = self.path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            return out
        for line in lines:
            try:
                row = json.loads(line)
                rel, kind = row["path"], row["kind"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(rel, str) and kind in KINDS and confined(rel):
                out.setdefault(rel, kind)
        return out

    def note(self, rel: str, kind: str, created: bool | None = None) -> None:
        """Record ``rel`` (relative to run.dir) as written by this run, if the run creates it: it does
        not exist yet (or ``created`` says so), or it is already recorded."""
        assert kind in KINDS and confined(rel), (rel, kind)
        full = self.run_dir / rel
        made = created if created is not None else not (full.exists() or full.is_symlink())
        if not made or rel in self.entries():
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"path": rel, "kind": kind}) + "\n")

    def make_dir(self, rel: str) -> Path:
        """Create folder ``rel`` (and its missing parents), recording each one this run made."""
        parts = Path(rel).parts
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if not (self.run_dir / sub).exists():
                self.note(sub, "dir")
                (self.run_dir / sub).mkdir()
        return self.run_dir / rel

    def rewrite(self, keep: dict[str, str]) -> None:
        """Replace the record with ``keep`` (atomically)."""
        tmp = self.path.with_name(self.path.name + ".partial")
        tmp.write_text("".join(json.dumps({"path": r, "kind": k}) + "\n" for r, k in keep.items()))
        tmp.rename(self.path)


def confined(rel: str) -> bool:
    """Whether ``rel`` names a path inside its folder: relative, no ``..``, no empty part."""
    p = Path(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "." not in rel.split("/")


def link_on_the_way(root: Path, rel: str) -> Path | None:
    """The first folder between ``root`` and ``root/rel`` that is a symbolic link (None = none):
    removing ``rel`` would follow it out of ``root``."""
    here = root
    for part in Path(rel).parts[:-1]:
        here = here / part
        if here.is_symlink():
            return here
    return None
