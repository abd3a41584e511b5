"""Resharding: a checkpoint saved under one layout and world size loads into another, and the next
step's loss equals the one the saving layout computed for that step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardwise import checkpoint
from tests.conftest import TINY_ARGS, metrics, run_cli

LOSS_RTOL = 1e-5  # the layouts' own parity tolerance (tests/distributed/test_parity.py)
PIPE = ["--data.document_mask=false", "--parallel.pp_schedule=gpipe"]
MOE = ["--data.document_mask=false", "--model.name=moe-debug", "--model.dim=64", "--model.n_layers=2",
       "--model.n_heads=4", "--model.n_kv_heads=2", "--model.moe_hidden_dim=32", "--model.n_experts=4"]

# name: (saving layout, loading layout, shared args)
CASES = {
    "fsdp4_to_fsdp2": (["--nproc=4"], ["--nproc=2"], []),
    "fsdp2xtp2_to_fsdp4": (["--nproc=4", "--parallel.tp=2"], ["--nproc=4"], []),
    "pp2_to_pp1": (["--nproc=2", "--parallel.pp=2"], [], PIPE),
    "ep2_to_ep1": (["--nproc=2", "--parallel.ep=2"], ["--nproc=2"], MOE),
    "tp2_to_1rank": (["--nproc=2", "--parallel.tp=2"], [], []),
}
SLOW = {"fsdp4_to_fsdp2", "ep2_to_ep1", "tp2_to_1rank", "pp2_to_pp1"}


def _layouts():
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]


@pytest.mark.parametrize("case", _layouts())
def test_checkpoint_loads_into_another_layout(case: str, tmp_path: Path, data_cache: str):
    save, load, shared = CASES[case]
    common = [*TINY_ARGS, f"--data.cache_dir={data_cache}", *shared]
    src = tmp_path / "src"
    run_cli(["train", *common, *save, f"--run.dir={src}", "--training.steps=5", "--checkpoint.interval=4",
             "--checkpoint.final=false"])
    step4 = src / "checkpoints" / "step-4"
    assert checkpoint.read_manifest(step4)["world_size"] == int(save[0].split("=")[1])
    dst = tmp_path / "dst"
    shutil.copytree(step4, dst / "checkpoints" / "step-4")
    run_cli(["train", *common, *load, f"--run.dir={dst}", "--training.steps=5", "--checkpoint.resume=true"])
    want, got = metrics(src)[-1], metrics(dst)
    assert [r["step"] for r in got] == [5]
    assert abs(got[0]["loss"] - want["loss"]) <= LOSS_RTOL * abs(want["loss"]), (got[0]["loss"], want["loss"])
    assert abs(got[0]["lr"] - want["lr"]) <= 1e-12
