"""What pyproject.toml promises: the Python it names runs the package, the runtime set is enough to
import every module, and each optional feature is an extra whose absence is one line."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from shardwise.config.extras import EXTRAS, require_extra
from shardwise.config.types import ConfigError
from tests.helpers import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Standard-library modules newer than some Python 3 still in use, by the version that added them.
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 11), "annotationlib": (3, 14),
                "compression": (3, 14), "string.templatelib": (3, 14)}


def _package_imports() -> set[str]:
    names = set()
    for path in (ROOT / "shardwise").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
    return names


def test_requires_python_is_what_the_package_needs_and_this_interpreter_has():
    spec = SpecifierSet(PROJECT["requires-python"])
    assert spec.contains(".".join(map(str, sys.version_info[:3])))  # the CI interpreter
    needed = max([v for m, v in NEWER_STDLIB.items() if m in _package_imports()], default=(3, 8))
    assert needed == (3, 11)  # tomllib: the check below would pass for any floor otherwise
    older = f"{needed[0]}.{needed[1] - 1}"
    assert not spec.contains(older), f"requires-python admits {older}, which lacks a module used here"
    assert spec.contains(f"{needed[0]}.{needed[1]}")


def _runtime_closure() -> set[str]:
    """The runtime dependencies and everything they need in turn (markers for this machine, no extras)."""
    todo = [Requirement(r) for r in PROJECT["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in (distribution(name).requires or [])]
    return seen


def _runtime_site(folder: Path) -> Path:
    """A site folder holding only the runtime set: links to each distribution's top-level files."""
    site = folder / "site"
    site.mkdir()
    for name in _runtime_closure():
        dist = distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".." and f.suffix != ".pth"}:
            if (src := Path(dist.locate_file(top))).exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return site


def test_every_module_imports_with_the_runtime_set_alone(tmp_path: Path):
    """A fresh interpreter without site-packages (``-S``) and only the runtime dependencies' closure on
    its path imports every module of the package."""
    code = """
import importlib, importlib.util, pkgutil, sys
import shardwise
names = [m.name for m in pkgutil.walk_packages(shardwise.__path__, "shardwise.")]
for name in names:
    importlib.import_module(name)
absent = [m for m in ("transformers", "datasets", "wandb", "lm_eval", "torchao", "pyarrow", "pytest")
          if importlib.util.find_spec(m) is not None]
print(len(names), absent, flush=True)
"""
    env = {"PYTHONPATH": f"{_runtime_site(tmp_path)}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    count, present = out.stdout.strip().split(" ", 1)
    assert int(count) > 60 and present == "[]", out.stdout  # (the optional ones are truly not there)


def test_the_documented_plan_runs_with_the_runtime_set_alone(tmp_path: Path):
    """README's plan of 8B (whose configs/8b.toml enables float8) on an install without the float8
    extra: it plans without float8 and says so, rather than refusing; training float8 there is one line."""
    env = {"PYTHONPATH": f"{_runtime_site(tmp_path)}:{ROOT}", "PATH": "/usr/bin:/bin"}

    def shardwise(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-m", "shardwise", *args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=300)

    out = shardwise("plan", "--model", "8b", "--nproc", "8", "--hardware", "h100", "--out", "p.toml")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "notice: float8.enabled needs the torchao package" in out.stdout
    assert "[float8]\nenabled = false" in (tmp_path / "p.toml").read_text()
    assert "[float8]\nenabled = true" in shardwise("train", "--model", "8b", "--print-config").stdout
    out = shardwise("train", "--config", str(ROOT / "configs/debug.toml"), "--float8.enabled")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "shardwise: error: float8.enabled=true needs the torchao package: pip install 'shardwise[float8]'")


def test_the_runtime_set_leaves_out_what_only_tests_and_options_use():
    runtime = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert not runtime & {"datasets", "torchao", "pyarrow", "wandb", "lm-eval", "transformers", "pytest",
                           "mlflow-skinny"}
    assert {"jinja2", "torch", "tokenizers", "safetensors"} <= runtime


def test_each_extra_installs_the_module_its_message_names():
    extras = PROJECT["optional-dependencies"]
    module_of = {"torchao": "torchao", "pyarrow": "pyarrow", "wandb": "wandb", "lm-eval": "lm_eval",
                 "mlflow-skinny": "mlflow"}
    for extra, module in EXTRAS.items():
        req, *helpers = extras[extra]  # (the first installs the module; mlflow's sqlite store needs two more)
        assert module_of[canonicalize_name(Requirement(req).name)] == module, extra
        assert all(r in extras["dev"] for r in (req, *helpers)), f"the tests need [{extra}] too"


def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        require_extra("float8", "float8.enabled=true")
    assert str(e.value) == "float8.enabled=true needs the torchao package: pip install 'shardwise[float8]'"
    require_extra("parquet", "data.path")  # installed here: no error


def test_jinja2_below_the_sandbox_fixes_is_not_admitted():
    """Chat templates come with downloaded models and run in jinja2's sandbox: 3.1.5 and earlier have
    known sandbox escapes (fixed in 3.1.6), so the requirement must exclude them."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    jinja = next(Requirement(d) for d in deps if Requirement(d).name == "jinja2")
    assert not jinja.specifier.contains("3.1.5") and jinja.specifier.contains("3.1.6")


def test_an_installed_wheel_ships_the_presets(tmp_path: Path):
    """The wheel, unpacked into a fresh site (with the runtime set, away from the repository): `--model
    8b` reads the preset's own configs/8b.toml -- it fell back to the built-in defaults when configs/
    was not package data."""
    import shutil
    import zipfile

    src = tmp_path / "src"  # (a copy: building in place would leave build/ in the repository)
    shutil.copytree(ROOT / "shardwise", src / "shardwise", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("shardwise-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert "shardwise/configs/8b.toml" in z.namelist()
        z.extractall(tmp_path / "installed")
    env = {"PYTHONPATH": f"{tmp_path / 'installed'}:{_runtime_site(tmp_path)}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-S", "-m", "shardwise", "train", "--model", "8b",
                          "--print-config"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "starting from 8b.toml" in out.stdout and "[float8]\nenabled = true" in out.stdout
    assert str(ROOT) not in out.stdout + out.stderr
