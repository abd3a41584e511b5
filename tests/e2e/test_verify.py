"""``shardwise verify`` end to end: real layouts pass, a wrong run fails, and the exit code says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config import ConfigError
from shardwise.verify import parse_layout
from tests.conftest import TINY_ARGS, metrics, run_cli

pytestmark = pytest.mark.e2e


def test_verify_passes_real_layouts_and_catches_a_wrong_one(tmp_path: Path, data_cache: str):
    args = [a for a in TINY_ARGS if not a.startswith(("--training.steps", "--eval.", "--checkpoint.",
                                                      "--metrics.tensorboard", "--metrics.plot",
                                                      "--metrics.progress", "--data.document_mask"))]
    out = tmp_path / "verify"
    # Unmasked attention: context parallel's ring attention is causal-only.
    proc = run_cli(["verify", *args, "--data.document_mask=false", f"--data.cache_dir={data_cache}",
                    "--steps=6", f"--out={out}", "--layouts", "dp_shard=2", "tp=2,dp_shard=2", "cp=2",
                    "dp_shard=2,optimizer.lr=0.002"],
                   check=False, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one layout must fail
    rows = {ln.split("|")[1].strip(): ln for ln in proc.stdout.splitlines() if ln.startswith("| ")}
    assert rows["dp_shard=2"].rstrip().endswith("| PASS |")
    assert rows["tp=2,dp_shard=2"].rstrip().endswith("| PASS |")
    assert rows["cp=2"].rstrip().endswith("| PASS |")
    assert "| FAIL" in rows["dp_shard=2,optimizer.lr=0.002"]
    assert "tolerances (fp32): loss rel <= 1e-05" in proc.stdout
    assert (out / "loss_overlay.png").stat().st_size > 10_000
    assert (out / "reference" / "checkpoints" / "step-0" / ".metadata").is_file()  # the seed


def test_parse_layout():
    args, world = parse_layout("tp=2,dp_shard=2,optimizer.lr=1e-3")
    assert world == 4 and "--parallel.tp=2" in args and "--parallel.dp_shard=2" in args
    assert "--optimizer.lr=1e-3" in args and "--parallel.dp_replicate=1" in args
    for bad, fragment in (("tq=2", "unknown degree 'tq'"), ("tp", "expected key=value"),
                          ("tp=two", "tp must be an integer")):
        with pytest.raises(ConfigError, match=fragment):
            parse_layout(bad)


def test_resume_takes_hyperparameters_from_the_config(tmp_path: Path, data_cache: str):
    """A resumed run uses the learning rate it is given, not the one saved in the checkpoint."""
    common = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path}",
              "--lr_scheduler.decay=constant", "--lr_scheduler.warmup_steps=0"]
    run_cli([*common, "--training.steps=2", "--checkpoint.final=true", "--optimizer.lr=0.003"])
    run_cli([*common, "--training.steps=4", "--checkpoint.resume=true", "--optimizer.lr=0.001"])
    lrs = [r["lr"] for r in metrics(tmp_path)]
    assert lrs == pytest.approx([0.003, 0.003, 0.001, 0.001])
