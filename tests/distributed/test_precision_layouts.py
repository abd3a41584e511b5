"""Float8, BF16 optimizer states and torch.compile with FSDP and TP: each against the single-rank
run with the same switch (gloo, fp32 master weights, deterministic), and BF16 states against FP32
states over a longer run.

Tolerances: float8 quantizes each GEMM input with a per-tensor scale; layouts that sum in another
order can move a value across a float8 rounding boundary now and then, so the loss bound is 1e-4
(fp32 layouts: 1e-5). If the amax were not all-reduced over TP, each rank would quantize with its
own scale and the loss would differ by ~1e-3. BF16 moments round to bf16 after each step: the same
1e-4. Compiled blocks (inductor's fused kernels) sum in their own order: 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import TINY_ARGS, check_layout_ran, layouts, max_rel, metrics, parity_run, run_cli

pytestmark = pytest.mark.dist

# A width whose MLP splits into multiples of 16 under tp=2 (192 / 2 = 96), so every block's
# attention and MLP GEMMs run in float8 on every layout.
FP8 = ["--model.multiple_of=32", "--float8.enabled=true", "--float8.min_dim=16"]
FP8_LAYOUTS = {
    "tp2": ["--nproc=2", "--parallel.tp=2"],
    "fsdp2_fp8_all_gather": ["--nproc=2", "--float8.fsdp_all_gather=true"],
    # (extended set: make test-all)
    "fsdp2_tp2_ac_selective": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2",
                               "--activation_checkpoint.mode=selective"],
}


def close_runs(ref: Path, run: Path, rtol: float, what: str, asked: list[str]) -> None:
    """``run`` ran the layout ``asked`` names and trained ``ref``'s run within ``rtol``."""
    check_layout_ran(run, asked, what)
    a, b = metrics(ref), metrics(run)
    loss = max_rel([r["loss"] for r in b], [r["loss"] for r in a])
    norm = max_rel([r["grad_norm"] for r in b], [r["grad_norm"] for r in a])
    assert loss <= rtol and norm <= 10 * rtol, f"{what}: loss {loss:.2e}, grad norm {norm:.2e}"
    assert a[-1]["loss"] < a[0]["loss"] - 0.2  # it trains


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("fp8"), "ref", data_cache, *FP8)


@pytest.mark.parametrize("layout", layouts(FP8_LAYOUTS, slow={"fsdp2_tp2_ac_selective"}))
def test_float8_layout_matches_single_rank(layout: str, fp8_reference: Path, tmp_path: Path,
                                           data_cache: str):
    run_dir = parity_run(tmp_path, layout, data_cache, *FP8, *FP8_LAYOUTS[layout])
    close_runs(fp8_reference, run_dir, 1e-4, layout, FP8_LAYOUTS[layout])


def test_float8_trains_like_high_precision(fp8_reference: Path, tmp_path: Path, data_cache: str):
    """The float8 run's losses stay within 1% of the high-precision run's (and are not equal)."""
    hp = parity_run(tmp_path, "hp", data_cache, "--model.multiple_of=32")
    diff = max_rel([r["loss"] for r in metrics(fp8_reference)], [r["loss"] for r in metrics(hp)])
    assert 1e-6 < diff < 1e-2, diff


def test_bf16_states_fsdp2_matches_single_rank_and_resumes_exactly(tmp_path: Path, data_cache: str):
    """BF16 AdamW states on FSDP2 DTensor shards: the 1-rank run's losses, and a resume from the
    step-4 distributed checkpoint continues bit-identically (states reload as bf16)."""
    states = ["--optimizer.state_dtype=bf16", "--checkpoint.interval=4"]
    ref = parity_run(tmp_path, "ref", data_cache, *states)
    full = parity_run(tmp_path, "fsdp2", data_cache, *states, "--nproc=2")
    close_runs(ref, full, 1e-4, "bf16 states fsdp2", ["--nproc=2"])
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    (full / "checkpoints" / "step-4").rename(part / "checkpoints" / "step-4")
    parity_run(tmp_path, "part", data_cache, *states, "--nproc=2", "--checkpoint.resume=true")
    want, got = metrics(full)[4:], metrics(part)
    assert [(r["loss"], r["grad_norm"]) for r in want] == [(r["loss"], r["grad_norm"]) for r in got]


@pytest.mark.parametrize("layout", [
    pytest.param(["--nproc=2"], marks=pytest.mark.slow),  # (extended set: make test-all)
    ["--nproc=2", "--parallel.tp=2"]], ids=["fsdp2", "tp2"])
def test_compile_with_checkpointing_matches_single_rank(layout: list[str], tmp_path: Path, data_cache: str):
    """Compiled, selectively checkpointed blocks under FSDP (and TP) against the eager 1-rank run.
    Under TP the embedding's in-flight reduce-scatter enters the first compiled block: torch 2.13
    dropped the gradient back to the embedding there (see shardwise/parallel/compile.py)."""
    ref = parity_run(tmp_path, "ref", data_cache)
    run_dir = parity_run(tmp_path, "compiled", data_cache, *layout, "--compile.enabled=true",
                         "--activation_checkpoint.mode=selective")
    close_runs(ref, run_dir, 1e-4, f"compile {layout}", layout)


@pytest.mark.slow  # (extended set: make test-all; CI keeps the FSDP2 bf16-state parity and exact resume)
def test_bf16_states_loss_curve_tracks_fp32_states(tmp_path: Path, data_cache: str):
    """200 steps of the tiny model: BF16 moments give the FP32-moment loss curve within 2% at every
    logged step (mean of each 20-step window)."""
    long = ["--training.steps=200", "--lr_scheduler.warmup_steps=20", "--data.document_mask=false"]
    curves = []
    for name, dtype in (("fp32", "fp32"), ("bf16", "bf16")):
        run_dir = tmp_path / name
        run_cli(["train", *_tiny(data_cache, run_dir), *long, f"--optimizer.state_dtype={dtype}"],
                timeout=600)
        losses = [r["loss"] for r in metrics(run_dir)]
        curves.append([sum(losses[i:i + 20]) / 20 for i in range(0, 200, 20)])
    fp32, bf16 = curves
    assert fp32[-1] < fp32[0] - 1.0  # it learns
    assert max_rel(bf16, fp32) < 2e-2, (fp32, bf16)


def _tiny(cache: str, run_dir: Path) -> list[str]:

    return [*TINY_ARGS, f"--data.cache_dir={cache}", f"--run.dir={run_dir}"]
