"""``shardwise train --data.synthetic=true``: a run on random ids over the model's vocabulary (here
4,096 rows, twice the shipped tokenizer's ids) trains, says so, and resumes bit for bit; eval of
it is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import metrics, run_cli, train_tiny

pytestmark = pytest.mark.e2e


def test_a_synthetic_run_trains_over_the_whole_vocabulary_and_resumes_exactly(tmp_path: Path,
                                                                              data_cache: str):
    common = ["--data.synthetic=true", "--model.vocab_size=4096", "--training.steps=6",
              "--checkpoint.interval=3"]
    full = train_tiny(tmp_path / "full", data_cache, *common)
    assert "notice: data.synthetic: seeded random token ids over all 4,096 rows" in full.stdout
    assert "rows beyond are never trained" not in full.stdout  # (no tokenizer is read)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-3", part / "checkpoints" / "step-3")
    train_tiny(part, data_cache, *common, "--checkpoint.resume=true")
    want, got = metrics(tmp_path / "full"), metrics(part)
    assert [r["step"] for r in got] == [4, 5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in want[3:]] == [(r["loss"], r["grad_norm"]) for r in got]
    assert min(r["loss"] for r in want) > 8.31  # ln 4096: no model predicts uniform ids better
    # its checkpoint is not scored on random ids: eval refuses in one line, before any rank starts
    scored = run_cli(["eval", "--checkpoint", str(tmp_path / "full" / "checkpoints" / "step-6")], check=False)
    assert scored.returncode == 2 and "no corpus to prepare, show or score" in scored.stderr, scored.stderr
