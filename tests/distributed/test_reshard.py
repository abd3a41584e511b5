"""Resharding: a checkpoint saved under one layout and world size loads into another and the run goes
on as if uninterrupted.

The saving layout trains 8 steps straight through, checkpointing at step 3; the loading layout
resumes that step-3 checkpoint and trains steps 4..8. Steps 4..8 must match the uninterrupted run in
loss and gradient norm (the layouts' own fp32 parity tolerance, 1e-5) and the final parameters within
1e-4 of how far those five steps moved them. Five steps of Adam depend on the restored moments: a
resume that lost the optimizer state fails this check (negative control below), which the first
step's loss alone would not show.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardwise import checkpoint
from shardwise.verify.parity import checkpoint_params, update_error
from tests.helpers import TINY_ARGS, check_layout_ran, max_rel, metrics, run_cli

LOSS_RTOL = 1e-5  # the layouts' own parity tolerances (tests/distributed/test_parity.py)
PARAM_RTOL = 1e-4
SAVE_AT, STEPS = 3, 8
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
    # one rank without FSDP (parallel.one_rank=plain, a GPU's default: plain tensors) and back
    "plain_to_fsdp2": (["--nproc=1", "--parallel.one_rank=plain"], ["--nproc=2"], []),
    "fsdp2_to_plain": (["--nproc=2"], ["--nproc=1", "--parallel.one_rank=plain"], []),
}
SLOW = {"fsdp4_to_fsdp2", "ep2_to_ep1", "tp2_to_1rank", "pp2_to_pp1", "fsdp2_to_plain"}


def _layouts():
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, data_cache: str):  # noqa: ANN201
    """The uninterrupted run of a case, trained once per module."""
    done: dict[str, Path] = {}

    def source(case: str) -> Path:
        if case not in done:
            save, _, shared = CASES[case]
            done[case] = uninterrupted(tmp_path_factory.mktemp(case), data_cache, save, shared)
        return done[case]
    return source


def uninterrupted(tmp_path: Path, cache: str, save: list[str], shared: list[str]) -> Path:
    src = tmp_path / "src"
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={cache}", *shared, *save, f"--run.dir={src}",
             f"--training.steps={STEPS}", f"--checkpoint.interval={SAVE_AT}", "--checkpoint.final=true"])
    assert checkpoint.read_manifest(src / "checkpoints" / f"step-{SAVE_AT}")["world_size"] == \
        int(save[0].split("=")[1])
    return src


def resumed(tmp_path: Path, cache: str, src: Path, load: list[str], shared: list[str],
            fault: str = "") -> Path:
    dst = tmp_path / f"dst{fault}"
    shutil.copytree(src / "checkpoints" / f"step-{SAVE_AT}", dst / "checkpoints" / f"step-{SAVE_AT}")
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={cache}", *shared, *load, f"--run.dir={dst}",
             f"--training.steps={STEPS}", "--checkpoint.resume=true", "--checkpoint.final=true"], fault=fault)
    return dst


def differences(src: Path, dst: Path) -> tuple[float, float, float]:
    """Steps SAVE_AT+1..STEPS of the resumed run against the uninterrupted one: loss and grad norm
    (max relative), and the final parameters relative to how far those steps moved them."""
    want, got = metrics(src)[SAVE_AT:], metrics(dst)
    assert [r["step"] for r in got] == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(abs(a["lr"] - b["lr"]) <= 1e-12 for a, b in zip(want, got, strict=True))
    final = lambda d: checkpoint_params(d / "checkpoints" / f"step-{STEPS}")  # noqa: E731
    return (max_rel([r["loss"] for r in got], [r["loss"] for r in want]),
            max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]),
            update_error(final(dst), final(src), checkpoint_params(src / "checkpoints" / f"step-{SAVE_AT}")))


@pytest.mark.parametrize("case", _layouts())
def test_checkpoint_loads_into_another_layout(case: str, sources, tmp_path: Path, data_cache: str):  # noqa: ANN001
    save, load, shared = CASES[case]
    src = sources(case)
    dst = resumed(tmp_path, data_cache, src, load, shared)
    check_layout_ran(src, save, f"{case} (saving)", step=STEPS)
    check_layout_ran(dst, load, f"{case} (loading)", step=STEPS)
    loss, norm, params = differences(src, dst)
    assert loss <= LOSS_RTOL and norm <= LOSS_RTOL and params <= PARAM_RTOL, (loss, norm, params)


def test_a_resume_that_loses_the_optimizer_state_fails_the_check(sources, tmp_path: Path,  # noqa: ANN001
                                                                  data_cache: str):
    """Negative control: the same resharded resume with Adam's moments thrown away after the load
    (tests/faults) is far outside the bounds -- the check sees optimizer state, not just weights."""
    _, load, shared = CASES["fsdp2xtp2_to_fsdp4"]
    src = sources("fsdp2xtp2_to_fsdp4")
    loss, norm, params = differences(src, resumed(tmp_path, data_cache, src, load, shared,
                                                  fault="drop_optimizer_state"))
    assert loss > 100 * LOSS_RTOL and params > 100 * PARAM_RTOL, (loss, norm, params)
