"""The package's shape, as docs/architecture.md describes it: no import cycles (function-local
imports counted), no function-local import of the package outside the CLI's per-command loading,
short functions and files, a loop that fits on one screen, and a config layer at the bottom."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "shardwise"
# The CLI imports each subcommand's modules inside that subcommand, so `shardwise --help` or
# `shardwise plan` never load the trainer, DCP or the data pipeline.
# The Python API (shardwise/api.py, shardwise/__init__.py) does the same: `import shardwise` stays light.
LAZY_OK = {"shardwise/cli.py", "shardwise/api.py", "shardwise/__init__.py",
           *(f"shardwise/commands/{p.name}" for p in (ROOT / "shardwise" / "commands").glob("*.py"))}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported package module, inside a function) for every import of the package."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardwise"):
            names = [_target(f"{node.module}.{a.name}") or _target(node.module) for a in node.names]
        elif isinstance(node, ast.Import):
            names = [_target(a.name) for a in node.names if a.name.startswith("shardwise")]
        out += [(node, n, id(node) in local) for n in names if n]
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {t for _, t, _ in _imports(p) if t != m} for m, p in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, or [] (depth-first search with the path kept)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_cycles_even_through_function_local_imports():
    assert _cycle(_graph()) == []
    # The search finds one when there is one (a planted edge back to the top).
    planted = _graph()
    planted["shardwise.config.types"].add("shardwise.trainer.train")
    assert _cycle(planted)


def test_no_function_local_imports_of_the_package_outside_the_cli():
    found = [f"{p.relative_to(ROOT)}:{node.lineno} {t}" for p in MODULES.values()
             if str(p.relative_to(ROOT)) not in LAZY_OK for node, t, local in _imports(p) if local]
    assert found == []


# The stages, bottom up (docs/architecture.md): a module imports only from its own stage and those
# below it. The library folders share a stage; the cycle test above keeps them acyclic.
STAGES = [{"config"}, {"runtime", "data", "ops", "models", "optim", "parallel", "observe", "checkpoint"},
          {"launch"}, {"resolve"}, {"trainer"}, {"infer", "plan", "verify"}, {"commands"}, {""}]


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else ""


def test_folders_import_only_their_own_stage_and_those_below():
    stage = {folder: i for i, folders in enumerate(STAGES) for folder in folders}
    found = sorted({name for name in MODULES} - {m for m in MODULES if _folder(m) in stage})
    assert found == [], f"modules outside every stage: {found}"
    upward = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets
                    if stage[_folder(t)] > stage[_folder(m)])
    assert upward == []
    folders: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        folders.setdefault(_folder(m), set()).update(_folder(t) for t in targets if _folder(t) != _folder(m))
    assert _cycle(folders) == []  # (no two library folders import each other, even indirectly)


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_mesh_names_are_spelled_once():
    """A mesh dim or view is named through ``parallel.dims.Mesh``: no string literal of a mesh name
    outside parallel/dims.py (docstrings aside)."""
    from shardwise.parallel.dims import Mesh

    names = {m.value for m in Mesh}
    found = []
    for name, path in MODULES.items():
        if name == "shardwise.parallel.dims":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        found += [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs]
    assert found == []


RESOLVES_MODELS = ("resolve", "checkpoint")
"""Where a ``[model]`` section becomes ``ModelArgs``: resolving a run (resolve/), reading a checkpoint's
record of one (checkpoint/). Everything else takes ``run.model`` or what those return."""


def test_parallelisms_know_models_only_through_their_plans():
    """``parallel/`` applies the plans a model declares (models/protocol.py) and imports nothing
    else of ``models/``: a new family adds its modules and plans there, and nothing to ``parallel/``
    (tests/unit/test_family_plan.py parallelizes a family written in the test)."""
    found = sorted(f"{m} -> {t}" for m, targets in _graph().items() if _folder(m) == "parallel"
                   for t in targets if _folder(t) == "models" and t != "shardwise.models.protocol")
    assert found == []


def test_models_are_resolved_in_one_place():
    """``model_args`` is called in resolution only -- not, as once, at 12 sites (8 in the planner)
    behind a memo cache -- and keeps no cache (two calls build two values)."""
    from shardwise.config.schema import ModelConfig
    from shardwise.models import model_args

    found = []
    for name, path in MODULES.items():
        if _folder(name) in RESOLVES_MODELS:
            continue
        found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Call) and (getattr(n.func, "id", None) == "model_args"
                                                  or getattr(n.func, "attr", None) == "model_args")]
    assert found == []
    section = ModelConfig(name="debug")
    assert model_args(section) == model_args(section) and model_args(section) is not model_args(section)


def test_no_test_imports_another_test():
    """Tests share code through tests/helpers.py and tests/references.py, never by importing one
    another (nor conftest.py, which holds fixtures only)."""
    shared = {"tests.helpers", "tests.references"}
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n.startswith("tests") and n not in shared]
    assert found == []


def test_config_sits_at_the_bottom():
    """config.py imports only leaf modules (the types, and sections kept in files of their own), which
    import nothing from the package but the types."""
    graph = _graph()
    assert graph["shardwise.config.schema"] <= {"shardwise.config.types", "shardwise.config.model_args",
                                                "shardwise.config.debug", "shardwise.config.lora"}
    for leaf in graph["shardwise.config.schema"]:
        assert graph[leaf] <= {"shardwise.config.types"}, leaf
    assert graph["shardwise.config.types"] == set()
    assert graph["shardwise.runtime.machine"] <= {"shardwise.config.types"}
    assert graph["shardwise.config.notice"] == set()


def test_the_cli_and_the_preparation_workers_start_without_torch():
    """`shardwise --help` answers at once, and each data-preparation worker (a spawned process that
    imports shardwise.data.prepare) does not pay for loading torch."""
    code = "import sys, shardwise.cli, shardwise.data.prepare; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def _functions(path: Path) -> list[ast.FunctionDef]:
    return [f for f in ast.walk(ast.parse(path.read_text()))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_functions_and_files_are_short():
    long_functions = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
                      for p in MODULES.values() for f in _functions(p) if f.end_lineno - f.lineno + 1 > 80]
    assert long_functions == []
    long_files = [str(p.relative_to(ROOT)) for p in MODULES.values() if len(p.read_text().splitlines()) > 500]
    assert long_files == []


def test_the_training_loop_fits_on_one_screen():
    funcs = {f.name: f for f in _functions(PACKAGE / "trainer" / "train.py")}
    train = funcs["train"]
    assert train.end_lineno - train.lineno + 1 <= 45
    (loop,) = [n for n in ast.walk(funcs["loop"]) if isinstance(n, ast.For)]
    assert loop.end_lineno - loop.lineno + 1 <= 25


def test_every_package_says_what_it_holds_and_the_readme_tours_them():
    """A folder listing tells a newcomer something: each package's __init__.py opens with a docstring,
    and the README's "Where things are" names every package."""
    packages = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))
    bare = [p.name for p in packages if ast.get_docstring(ast.parse((p / "__init__.py").read_text())) is None]
    assert bare == []
    readme = (ROOT / "README.md").read_text()
    tour = readme[readme.index("## Where things are"):]
    assert [p.name for p in packages if f"`{p.name}" not in tour and f"{p.name}/" not in tour] == []


def test_docs_are_guides_not_notebooks():
    """docs/planning.md a guide of at most 250 lines, no docs page over 600, no BENCHMARKS.md table cell
    over 300 characters (the rounds and long explanations live in bench/results/history.md)."""
    lengths = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "docs").glob("*.md")}
    assert lengths["planning.md"] <= 250, lengths["planning.md"]
    assert {n: k for n, k in lengths.items() if k > 600} == {}
    cells = [c.strip() for line in (ROOT / "BENCHMARKS.md").read_text().splitlines()
             if line.startswith("|") for c in line.strip("|").split("|")]
    assert cells and max(len(c) for c in cells) <= 300, max(cells, key=len)[:120]


MEASUREMENT_STORY = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\bround [A-Z]\b|\bmeasured on (a|an|the)\b|\bonce measured\b|\bthat day\b"
    r"|\b(came|went|grew|fell) .{0,40}\bonce\b"
    r"|\b(one|two|three|four|five|\d+) of (two|three|four|five|six|\d+) runs\b"
    r"|\d[\d,.]*\s*->\s*[\d,.]+\s*(tok/s|tokens/s|GiB|MiB|GB|ms|s)\b")
"""A dated figure or a run's story: a date, "round X", "measured on a/the ...", "once measured", "that
day", "came out at ... once", "in two of four runs", "459 -> 619 tok/s"."""


def test_source_states_rules_not_dated_measurements():
    """Docstrings, comments and the shipped TOMLs (configs/ -- a link to shardwise/configs -- and the
    hardware profiles) give a rule or a reason, with a pointer to the benchmark or the guide at most:
    no dated figure or run's story (:data:`MEASUREMENT_STORY`; those live in bench/results/history.md)."""
    files = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.toml")]
    assert (ROOT / "configs" / "debug.toml").resolve().is_relative_to(PACKAGE)  # (configs/ is scanned)
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if MEASUREMENT_STORY.search(line)]
    assert found == []
    for story in ("took 2.2 ms (measured on an H200, 2026-11-26)", "7 calls in a row once measured 16 MiB",
                  "about 577 GiB per GPU by `shardwise estimate` that day", "it came out at -0.5 ms once",
                  "(at 1x: 1.6-1.7x in two of four runs)", "a quarter of a step (459 -> 619 tok/s)",
                  "a rank grew 0.6 -> 1.5 GiB over 40 steps", "(0.5 -> 0.25 s here)"):
        assert MEASUREMENT_STORY.search(story), story
    assert not MEASUREMENT_STORY.search("(B, S) -> logits (B, S, vocab), measured by bench/gpu_model.py")


def test_tests_read_fixtures_from_tests_not_from_the_benchmark_record():
    """bench/results/ is a record that grows; what a test compares against is frozen under tests/fixtures/.
    (test_docs_commands.py runs documented bench commands, which name their own inputs.)"""
    readers = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
               if p.name not in ("test_docs_commands.py", "test_structure.py")
               and re.search(r"bench/results/|\"bench\" / \"results\"", p.read_text())]
    assert readers == []


def test_one_table_of_commands():
    """Each command is one module of shardwise/commands (its name, flags, examples and run function),
    the table holds every one, and the CLI dispatches from it: no branch per command."""
    from shardwise.commands import COMMANDS

    folder = ROOT / "shardwise" / "commands"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "common"}
    assert {m.__name__.rsplit(".", 1)[1] for m in COMMANDS.values()} == modules
    for name, m in COMMANDS.items():
        assert m.NAME == name and m.EXAMPLES and all(f" {name}" in e for e in m.EXAMPLES), name
        assert callable(m.add_arguments) and callable(m.run), name
    cli = (ROOT / "shardwise" / "cli.py").read_text()
    assert "args.command ==" not in cli and not any(f'"{name}"' in cli for name in COMMANDS)


COMMAND_INTERFACE = {"run", "add_arguments"}
"""What every command module defines (shardwise/commands/__init__.py); __main__.run is the console entry."""
API = {"train", "load", "plan", "verify", "estimate", "eval", "prepare", "convert", "download"}
"""The Python API's calls (shardwise/api.py), named after the commands they run."""


def test_one_name_per_function():
    """No two public functions or classes share a name across the package (a reader who greps a name
    finds one thing), except the interface every command module implements."""
    where: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(name)
    assert {n: m for n, m in where.items() if len(m) > 1 and n not in COMMAND_INTERFACE | API} == {}
