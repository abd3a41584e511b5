"""Golden loss curves (scripts/golden.py): each family's 20-step fp32 deterministic run on one rank
matches its stored curve -- bitwise on a CPU kind that has one recorded, within the measured
cross-kind spread on another -- and a changed update moves it past both bounds. And the default
recipe trains without the spike its old recipe had."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, metrics, run_cli

_spec = importlib.util.spec_from_file_location("golden", ROOT / "scripts" / "golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

RECORD = 'python scripts/golden.py --record --reason "why the curves move"'


# (qwen3-tiny and moe-debug: make test-all; the MoE step is held to HF's in test_train_step.py)
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f != "llama-debug" else f
                                    for f in golden.FAMILIES])
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


def test_the_cross_kind_bounds_are_about_4x_the_spread_between_recorded_kinds():
    """OTHER_KIND_RTOL, as its docstring says, is 3-6x the largest difference between two recorded
    kinds' curves of a family (a new kind's curve that widens the spread fails this until the bound
    is measured again)."""
    spread = {"loss": 0.0, "grad_norm": 0.0}
    for family in golden.FAMILIES:
        stored = json.loads((golden.GOLDEN / f"{family}.json").read_text())["curves"]
        curves = [c["curve"] for c in stored.values()]
        for i, a in enumerate(curves):
            for b in curves[i + 1:]:
                for key in spread:
                    spread[key] = max(spread[key], golden.deviation(a, b, (key,))[0])
    assert len(curves) >= 2 and min(spread.values()) > 0
    ratios = {key: golden.OTHER_KIND_RTOL[key] / spread[key] for key in spread}
    assert all(3 <= r <= 6 for r in ratios.values()), (ratios, spread)


def test_recording_keeps_other_kinds_and_says_why(monkeypatch: pytest.MonkeyPatch):
    with tempfile.TemporaryDirectory() as tmp:
        monkeypatch.setattr(golden, "GOLDEN", Path(tmp))
        first = {"loss": [2.0, 1.0], "grad_norm": [1.0, 1.0]}
        golden.record("llama-debug", first, "AVX2", "first")
        out = golden.record("llama-debug", {"loss": [2.0, 1.1], "grad_norm": [1.0, 1.0]}, "AMX", "second")
        assert "largest difference to AVX2: 1.00e-01" in out
        stored = (Path(tmp) / "llama-debug.json").read_text()
        assert '"AVX2"' in stored and '"AMX"' in stored and '"second"' in stored


@pytest.mark.slow  # (26 steps of the MoE preset: 3 min of make test's 30; make test-all runs it)
def test_the_deepseek_recipe_does_not_spike_at_its_peak_learning_rate(tmp_path: Path, data_cache: str):
    """deepseek-debug's step-13 spike (docs/training.md, "deepseek-debug's spike"): after a 10-step
    warm-up, one update at the peak learning rate grew block 1's attention output fourfold and every
    window's hidden state turned onto the never-seen tokens' drift (loss 5.7 -> 10.3). The recipe's
    25-step warm-up trains to its peak learning rate and a step past it with no step above 1.3x the
    mean of the 10 before it (with warm-up 10: 1.58x at step 13; a warm-up cut to 16 steps: 1.42x at
    step 16). Held at the peak for 35 more steps it stays under 1.02x (docs/training.md)."""
    run_dir = tmp_path / "run"
    run_cli(["train", "--config", "configs/deepseek-debug.toml", "--training.steps=26",
             "--lr_scheduler.decay=constant", "--eval.interval=0",
             "--checkpoint.interval=0", "--checkpoint.final=false", "--metrics.plot=false",
             "--metrics.tensorboard=false", "--metrics.log_format=line", f"--run.dir={run_dir}",
             f"--data.cache_dir={data_cache}"])
    loss = [r["loss"] for r in metrics(run_dir)]
    ratios = [loss[i] / (sum(loss[i - 10:i]) / 10) for i in range(10, len(loss))]  # steps 11-26
    assert len(loss) == 26 and max(ratios) < 1.3, ratios


def test_the_debug_recipe_keeps_attention_logits_bounded_at_its_peak_learning_rate(tmp_path: Path,
                                                                                  data_cache: str):
    """The default run's step-18 spike (docs/training.md, "Why the default run spiked"): without
    QK-norm, attention logits grew from 4 to 30 between steps 11 and 30 at the preset's peak
    learning rate, and one update flipped a few windows' hidden states onto the direction the
    never-seen tokens' output rows had drifted along. configs/debug.toml as written, held at its peak
    learning rate after warm-up (the harsher schedule; fp32), trains 16 steps with no spike and its
    largest attention logit stays under 8 (without QK-norm: 14.0 at step 16, 19.8 at step 20)."""
    from shardwise.data.dataset import open_corpus
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.infer.generate import load_for_generation
    from shardwise.observe.attention import attention_stats
    from shardwise.resolve.checks import load_config

    run_dir = tmp_path / "run"
    proc = run_cli(["train", "--config", "configs/debug.toml", "--training.steps=16",
                    "--lr_scheduler.decay=constant", "--training.mixed_precision=fp32", "--eval.interval=0",
                    "--checkpoint.interval=0", "--metrics.plot=false", "--metrics.tensorboard=false",
                    "--metrics.log_format=line", f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}"])
    assert "loss spike" not in proc.stdout
    loss = [r["loss"] for r in metrics(run_dir)]
    ratios = [loss[i] / (sum(loss[i - 10:i]) / 10) for i in range(10, len(loss))]  # steps 11-16
    assert max(ratios) < 1.3, ratios
    cfg = load_config("configs/debug.toml", [f"--data.cache_dir={data_cache}"])
    stream = open_corpus(cfg.data, load_tokenizer("")).train[0]
    tokens = torch.stack([torch.from_numpy(stream.window(i, 512)[0]) for i in range(0, 800, 100)])  # (8, 512)
    model = load_for_generation(checkpoint=str(run_dir)).model
    assert max(s.max_logit for s in attention_stats(model, tokens)) < 8.0
