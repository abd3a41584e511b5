"""The first commands a new user types work with the presets' defaults, exactly as typed (the tests
add only a run directory or output folder of their own and the shared token cache)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from shardwise.cli import main
from tests.helpers import metrics, run_cli

pytestmark = pytest.mark.e2e


def test_a_five_step_smoke_run(tmp_path: Path, data_cache: str):
    """The debug preset warms up over 10 steps: a 5-step run clamps the warmup, with one notice."""
    proc = run_cli(["train", "--config", "configs/debug.toml", "--training.steps", "5",
                    f"--run.dir={tmp_path}", f"--data.cache_dir={data_cache}"], timeout=900)
    assert proc.stdout.count("notice: lr_scheduler.warmup_steps=10 is longer than training.steps=5") == 1
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert tomllib.loads((tmp_path / "config.toml").read_text())["lr_scheduler"]["warmup_steps"] == 5


def test_pipeline_on_two_ranks_picks_its_micro_batch(tmp_path: Path, data_cache: str):
    """`--parallel.pp 2` without a micro-batch: one is chosen (and said) that the schedule accepts."""
    proc = run_cli(["train", "--config", "configs/debug.toml", "--nproc", "2", "--parallel.pp", "2",
                    "--training.steps", "2", f"--run.dir={tmp_path}", f"--data.cache_dir={data_cache}"],
                   timeout=900)
    assert proc.stdout.count("notice: parallel.pp=2: training.micro_batch=1 (8 micro-batches per step") == 1
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    assert tomllib.loads((tmp_path / "config.toml").read_text())["training"]["micro_batch"] == 1


@pytest.mark.slow  # (make test-all; in CI test_verify.py verifies pp=2 on the tiny model)
def test_verify_a_pipeline_layout(tmp_path: Path, data_cache: str):
    proc = run_cli(["verify", "--config", "configs/debug.toml", "--layouts", "pp=2", "--steps", "3",
                    f"--out={tmp_path}", f"--data.cache_dir={data_cache}"], timeout=900)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| pp=2 | 2 |")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| PASS |")


def test_plan_405b_at_sequence_8192(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """The default global batch is one sequence per device at the planned length (here 512 x 8192 =
    4M tokens), so any --seq works; a plan.toml already there is kept."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.toml").write_text("# mine\n")
    assert main(["plan", "--model", "405b", "--nproc", "512", "--hardware", "h100", "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    plan = tomllib.loads((tmp_path / "plan.toml").read_text())
    assert plan["training"]["seq_len"] == 8192 and plan["training"]["global_batch"] == 512
    assert "the earlier plan.toml is kept as plan." in out
    assert [p.read_text() for p in tmp_path.glob("plan.*.toml")] == ["# mine\n"]
