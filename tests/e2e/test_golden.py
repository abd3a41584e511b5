"""Golden loss curves (scripts/golden.py): each family's 20-step fp32 deterministic run on one rank
matches its stored curve -- bitwise on a CPU kind that has one recorded, within the measured
cross-kind spread on another -- and a changed update moves it past both bounds."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("golden", ROOT / "scripts" / "golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

RECORD = 'python scripts/golden.py --record --reason "why the curves move"'


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "qwen3-tiny" else f
                                    for f in golden.FAMILIES])  # (qwen3-tiny: make test-all)
def test_family_matches_its_golden_curve(family: str, tmp_path: Path):
    passed, line = golden.check(family, golden.run_family(family, tmp_path), golden.cpu_kind())
    assert passed, f"{line}\nif the change is meant, re-record: {RECORD}"


@pytest.mark.slow  # (make test-all: the bounds' sensitivity, measured once per change of them)
def test_a_changed_update_moves_the_curve_past_both_bounds(tmp_path: Path):
    golden.FAMILIES["lr-off"] = [*golden.FAMILIES["llama-debug"], "--optimizer.lr=3.03e-3"]  # 1% off
    try:
        curve = golden.run_family("lr-off", tmp_path)
    finally:
        del golden.FAMILIES["lr-off"]
    for kind in (golden.cpu_kind(), "a kind with no curve"):
        passed, line = golden.check("llama-debug", curve, kind)
        assert not passed and "MOVED" in line, line


def test_recording_keeps_other_kinds_and_says_why(monkeypatch: pytest.MonkeyPatch):
    with tempfile.TemporaryDirectory() as tmp:
        monkeypatch.setattr(golden, "GOLDEN", Path(tmp))
        first = {"loss": [2.0, 1.0], "grad_norm": [1.0, 1.0]}
        golden.record("llama-debug", first, "AVX2", "first")
        out = golden.record("llama-debug", {"loss": [2.0, 1.1], "grad_norm": [1.0, 1.0]}, "AMX", "second")
        assert "largest difference to AVX2: 1.00e-01" in out
        stored = (Path(tmp) / "llama-debug.json").read_text()
        assert '"AVX2"' in stored and '"AMX"' in stored and '"second"' in stored
