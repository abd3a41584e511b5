"""The README is a guide: short, its commands checked elsewhere (tests/e2e/test_docs_commands.py), and
no figure of its own -- each number it states is also in BENCHMARKS.md or docs/status.md, where the
machine and the command behind it are."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def _prose(text: str) -> str:
    """The text without code blocks, inline code and link targets."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def test_the_readme_is_short_with_short_lines():
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    assert max(len(line) for line in lines) <= 200


def test_every_number_in_the_readme_is_also_where_its_evidence_is():
    evidence = (ROOT / "BENCHMARKS.md").read_text() + (ROOT / "docs" / "status.md").read_text()
    numbers = set(re.findall(r"(?<![\w.-])\d+(?:[.,]\d+)*(?![\w-])", _prose(README)))  # not bf16, Qwen3
    assert numbers, "the check reads the README's prose"
    assert sorted(n for n in numbers if n not in evidence) == []


def test_the_status_table_has_short_cells_and_names_a_test_per_row():
    rows = [line for line in (ROOT / "docs" / "status.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| feature")]
    assert len(rows) > 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3 and max(len(c) for c in cells) <= 200, row[:80]
        assert re.search(r"`(tests|bench)/", cells[2]), f"no test or benchmark named: {row[:80]}"


def test_the_cli_guide_names_every_preset():
    """docs/cli.md's list of --model names is the presets' table, no more, no less."""
    from shardwise.models import PRESETS

    text = (ROOT / "docs" / "cli.md").read_text()
    line = text[text.index("- `--model NAME`"):text.index("- `--config FILE`")]
    listed = set(re.findall(r"`([\w.-]+)`", line.split("in `train`")[0])) - {"--model NAME"}
    assert listed == set(PRESETS), sorted(listed ^ set(PRESETS))


@pytest.mark.parametrize("flag", ["--overwrite", "--skip-checksums"])
def test_the_cli_guide_lists_every_command_a_shared_flag_is_on(flag: str):
    """docs/cli.md's ``- `--flag` (`cmd`, ...)`` list is exactly the commands whose parser takes it."""
    from shardwise.commands import build_parser

    _, commands = build_parser()
    takes = {name for name, p in commands.items() if flag in p._option_string_actions}
    text = (ROOT / "docs" / "cli.md").read_text()
    listed = set(re.findall(r"`([\w-]+)`", re.search(rf"^- `{flag}` \(([^)]*)\)", text, re.M).group(1)))
    assert listed == takes, f"docs/cli.md {flag}: listed {sorted(listed)}, parsers {sorted(takes)}"


def test_the_status_page_says_which_commit_the_gpu_tests_last_passed_on():
    """docs/status.md's GPU section names the commit the GPU tests last passed on, one of this history's."""
    import subprocess

    from tests.helpers import need

    text = (ROOT / "docs" / "status.md").read_text()
    section = text[text.index("## GPUs"):text.index("## Correctness")]
    found = re.search(r"last\s+passed on the tree committed as `([0-9a-f]{7,40})`", section)
    assert found, "docs/status.md's GPU section names no commit the GPU tests last passed on"
    need("git history", (ROOT / ".git").exists())
    subprocess.run(["git", "cat-file", "-e", f"{found.group(1)}^{{commit}}"], cwd=ROOT, check=True)
