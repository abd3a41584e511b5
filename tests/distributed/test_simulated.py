"""``verify --ranks``: layouts trained as simulated ranks in one process (torch's LocalTensorMode and
shardwise/trainer/simulate.py's adapters) compute what the real processes of the same layout do,
and the 64-rank verify of the debug preset's widest layout passes (fp32, gloo for the real runs)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from shardwise.config.schema import Config
from shardwise.models.transformer import build_model, init_weights
from shardwise.plan.comm import totals
from shardwise.plan.estimate import estimate
from shardwise.plan.hardware import load_hardware
from shardwise.plan.states import Coordinates, shape_states
from shardwise.resolve.checks import load_config
from shardwise.resolve.run import resolve_model, resolve_run
from shardwise.verify.parity import checkpoint_params
from shardwise.verify.shrink import shrink
from shardwise.verify.simulated import simulated_states, train_simulated
from tests.helpers import (
    DEEPSEEK_ARGS,
    MOE_ARGS,
    ROOT,
    by_ranks,
    check_layout_ran,
    initial_params,
    metrics,
    parity_run,
    run_cli,
)

pytestmark = pytest.mark.dist

# Each real layout's twin trained as simulated ranks. A vocabulary of 2,050 rows makes FSDP's chunks
# uneven (dp_shard=2: 1,025 rows -> 513 + 512 after TP's halves; dp_shard=4: 513 + 513 + 513 + 511), so
# ranks hold shards of different sizes, which the simulation must give each rank as its own.
VOCAB = "--model.vocab_size=2050"
LAYERS = "--model.n_layers=6"  # (pipeline twins: more stages than the tiny model's 2 blocks)
TWINS = {
    "hsdp2x2": ["--nproc=4", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
    # Pipeline ranks run as threads, each its own stages (MPMD): zero-bubble V puts two stages of
    # uneven splits (6 blocks: 2, 2, 1, 1) on each rank and splits their backward in two.
    "pp2_fsdp2_zbv": ["--nproc=4", LAYERS, "--parallel.pp=2", "--parallel.dp_shard=2",
                      "--parallel.pp_schedule=zbv"],
    # MoE: each rank's routing decides its all-to-all's uneven splits and its experts' group sizes
    # (2 of the 4 experts on each of the ep ranks, FSDP over the other 2, TP's sequence shards routed)
    "moe_ep2_tp2": ["--nproc=4", *MOE_ARGS, "--parallel.ep=2", "--parallel.tp=2"],
}
# (make test-all: HSDP x TP is in make test through the 64-rank verify below)
SLOW_TWINS = {
    "hsdp2_fsdp2_tp2": ["--nproc=8", "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.tp=2"],
    "fsdp4": ["--nproc=4", "--parallel.dp_shard=4"],
    "fsdp2_tp2": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2"],
    "fsdp8": ["--nproc=8", "--parallel.dp_shard=8"],
    "pp4_1f1b": ["--nproc=4", LAYERS, "--parallel.pp=4"],
    "pp2_tp2_interleaved": ["--nproc=4", LAYERS, "--parallel.pp=2", "--parallel.tp=2",
                            "--parallel.pp_schedule=interleaved1f1b"],
    # (two stages per rank over TP x FSDP: the embedding's and head's FSDP roots are stage views)
    "pp2_fsdp2_tp2_interleaved": ["--nproc=8", LAYERS, "--parallel.pp=2", "--parallel.dp_shard=2",
                                  "--parallel.tp=2", "--parallel.pp_schedule=interleaved1f1b"],
    "pp2_hsdp2x2_dualpipev": ["--nproc=8", LAYERS, "--parallel.pp=2", "--parallel.dp_replicate=2",
                              "--parallel.dp_shard=2", "--parallel.pp_schedule=dualpipev",
                              "--training.global_batch=16"],  # (dualpipev: 4 micro-batches per dp rank)
    "pp2_fsdp2_gpipe": ["--nproc=4", LAYERS, "--parallel.pp=2", "--parallel.dp_shard=2",
                        "--parallel.pp_schedule=gpipe"],
    "moe_fsdp4_ep2": ["--nproc=4", *MOE_ARGS, "--parallel.ep=2"],
    "moe_hsdp2_ep2_ac_full": ["--nproc=4", *MOE_ARGS, "--parallel.dp_replicate=2", "--parallel.ep=2",
                              "--activation_checkpoint.mode=full"],
    "moe_pp2_ep2": ["--nproc=4", *MOE_ARGS, LAYERS, "--parallel.pp=2", "--parallel.ep=2"],
    # DeepSeek-V3's routing (groups, sigmoid scores, the balancing bias) and latent attention
    "ds_ep2_fsdp2_tp2": ["--nproc=4", *DEEPSEEK_ARGS, "--parallel.ep=2", "--parallel.tp=2"],
    "ds_pp2_tp2_ep2": ["--nproc=4", *DEEPSEEK_ARGS, LAYERS, "--parallel.pp=2", "--parallel.tp=2",
                       "--parallel.ep=2"],
    # 8 experts over ep=4 (2 a rank) of HSDP 2 x FSDP 2 x TP 2
    "moe8_hsdp2_fsdp2_tp2_ep4": ["--nproc=8", *MOE_ARGS, "--model.n_experts=8", "--parallel.dp_replicate=2",
                                 "--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.ep=4"],
}


def _gib(n: int) -> float:
    return n / 2**30


@pytest.mark.parametrize("layout", [*TWINS, *(pytest.param(k, marks=pytest.mark.slow) for k in SLOW_TWINS)])
def test_simulated_ranks_train_what_the_real_processes_of_the_layout_train(layout: str, tmp_path: Path,
                                                                          data_cache: str):
    """The real run of the layout (gloo processes) and its simulated twin from the same initial
    weights: the same loss at every step (6, or 3 for a pipeline) on every rank (fp32, 1e-6 relative), the
    same final parameters, and every rank's parameter and optimizer bytes equal to that real rank's
    (memory_breakdown.json): the same shards, so the same layout ran; and equal to the planner's
    figure for that rank's coordinates. The process's environment is as it was (a variable left
    behind made every later command of the suite start a fresh interpreter)."""
    args = {**TWINS, **SLOW_TWINS}[layout]
    world, steps = int(args[0].split("=")[1]), 3 if LAYERS in args else 6  # (pipelines: 6 blocks, 3 steps)
    real = parity_run(tmp_path, layout, data_cache, *args, VOCAB, f"--training.stop_after={steps}")
    check_layout_ran(real, args, layout, step=steps)
    cfg = load_config(real / "config.toml")
    final = checkpoint_params(real / "checkpoints" / f"step-{steps}")
    env = dict(os.environ)
    sim = train_simulated(cfg, world, steps, initial_params(real), final)
    assert dict(os.environ) == env
    real_loss = [m["loss"] for m in metrics(real)]
    assert len(sim.losses) == len(real_loss) == steps
    for step, (ranks, want) in enumerate(zip(sim.losses, real_loss, strict=True), 1):
        assert sorted(ranks) == list(range(world))
        for rank, got in ranks.items():
            assert abs(got - want) <= 1e-6 * abs(want), (step, rank, got, want)
    assert sim.param_rel <= 1e-5, sim.worst  # against the real layout's own final weights
    memory = json.loads((real / "memory_breakdown.json").read_text())
    for key in ("params", "optimizer"):
        want = memory[f"{key}_per_rank"]
        got = [_gib(sim.states[r][key]) for r in range(world)]
        assert got == pytest.approx(want, rel=1e-12), key
    assert sim.states == planned_states(cfg, world)  # the planner's rule, rank by rank


def planned_states(cfg: Config, world: int) -> dict[int, dict[str, int]]:
    """The planner's parameter and optimizer bytes of every rank of ``cfg``'s layout (shape_states at
    each rank's coordinates: its pp, tp and dp_shard x cp index)."""
    run = resolve_run(cfg, world, detect_device=False)
    d, out = run.dims, {}
    for r in range(world):
        t, c, shard = r % d.tp, r // d.tp % d.cp, r // (d.tp * d.cp) % d.dp_shard  # (pp outermost)
        moe = r % (d.dp_shard * d.cp * d.tp)  # (an MoE block's shard group; ep its innermost ranks)
        at = Coordinates(tp=t, fsdp=shard * d.cp + c, ep=moe % d.ep, moe=moe, efsdp=moe // d.ep)
        st = shape_states(run, pp_ranks=[r // (world // d.pp)], at=at)[0]
        out[r] = {"params": st.params, "optimizer": st.optimizer}
    return out


def test_verify_ranks_64_passes_the_debug_presets_widest_layout(tmp_path: Path, data_cache: str):
    """``shardwise verify --ranks 64`` on the debug preset (6 blocks, 16 heads, batch of 8 sequences,
    here of 128 tokens): PP 2 x HSDP 2 x FSDP 2 x TP 8 as 64 simulated ranks, fp32, against the real
    one-rank reference: it passes, on the mesh asked for, every rank holding its 1/16 shard of each
    FSDP x TP weight of its stage's half of the model."""
    out = tmp_path / "verify"
    proc = run_cli(["verify", "--config", str(ROOT / "configs" / "debug.toml"), "--ranks", "64", "--layouts",
                    "pp=2,dp_replicate=2,dp_shard=2,tp=8", "--steps", "2", "--training.seq_len=128",
                    "--training.mixed_precision=fp32",
                    f"--data.cache_dir={data_cache}", "--out", str(out)], timeout=600)
    text = proc.stdout
    assert "64 simulated ranks on a mesh of pp=2 x dp_replicate=2 x dp_shard=2 x tp=8" in text, text
    row = re.search(r"^\| pp=2,dp_replicate=2,dp_shard=2,tp=8 \| 64 \|.*\| (PASS|FAIL) \|$", text, re.M)
    assert row and row.group(1) == "PASS", text
    low, high = (int(n.replace(",", "")) for n in re.search(r"parameter bytes per rank ([\d,]+)\.\.([\d,]+)",
                                                             text).groups())
    ref = sum(t.numel() * 4 for t in checkpoint_params(out / "reference" / "checkpoints" / "step-0").values())
    # A stage holds about half the model (the embedding and the head are alike in size), each weight
    # split 16 ways (dp_shard x tp: the norms only over dp_shard): about 1/32 of the model per rank.
    assert ref / 40 < low <= high < ref / 20, (low, high, ref)


def test_a_layout_fault_fails_the_simulated_verify(tmp_path: Path, data_cache: str):
    """A planted fault (block 1's FSDP unit reduces its gradients doubled) fails ``verify --ranks 2``
    (one step of sequences of 128), where the layouts above pass: the simulated comparison can fail,
    and localizing it on the same simulated ranks names block 1's gradients."""
    proc = _faulty_verify(tmp_path, data_cache, 2, "dp_shard=2", "fsdp_unit_grad_scale")
    assert re.search(r"^\| dp_shard=2 \| 2 \|.*\| FAIL \|$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^dp_shard=2: first difference at the gradient of layers\.1\.\S+: "
                     r"relative 1\.00e\+00 .*split over dp_shard$", proc.stdout, re.M), proc.stdout


def test_a_pipeline_split_that_loses_the_remainder_blocks_fails_naming_one(tmp_path: Path, data_cache: str):
    """A planted split that gives 4 stages 6 // 4 = 1 block each (blocks 4 and 5 held by no stage)
    fails ``verify --ranks 4 --layouts pp=4``, names a parameter no rank holds, and its localizing
    names block 4 as held by no rank."""
    proc = _faulty_verify(tmp_path, data_cache, 4, "pp=4", "pp_drop_remainder")
    assert re.search(r"^\| pp=4,dp_shard=1 \| 4 \|.*\| FAIL \|$", proc.stdout, re.M), proc.stdout
    assert re.search(r"largest parameter gap at layers\.[45]\.\S+ \(held by no rank; 2\d missing\)",
                     proc.stdout), proc.stdout
    # localized on the same simulated ranks: the first module of block 4 runs on no stage
    assert re.search(r"^pp=4,dp_shard=1: first difference at the output of layers\.4\.attention_norm: "
                     r"relative inf .*; held by no rank$", proc.stdout, re.M), proc.stdout



def test_the_405b_preset_shrunk_verifies_offline_against_its_own_fp32_noise(tmp_path: Path):
    """``verify --ranks`` of configs/405b.toml, shrunk 64-fold and cut to 2 of its blocks. No data is
    named and no Llama 3 tokenizer is here: every run trains on random ids over its 128,256-row
    vocabulary (data.synthetic), and the preset's float8 and compile are turned off, each said in a
    notice. Its gradients sit near Adam's
    eps, so TP's reordered sums move the first update 1.5e-4 apart, past the fixed 1e-4 bound: verify
    then measures the run's own fp32 noise (the reference with TP's rounding) and judges against 3x
    it; a learning rate off by a quarter still fails."""
    out = tmp_path / "verify"
    proc = run_cli(["verify", "--config", str(ROOT / "configs" / "405b.toml"), "--ranks", "2", "--shrink",
                    "--layouts", "tp=2", "tp=2,optimizer.lr=6e-5", "--steps", "1",
                    "--training.seq_len=64", "--training.global_batch=8", "--training.mixed_precision=fp32",
                    "--model.n_layers=2", "--out", str(out)], timeout=600, check=False)
    text = proc.stdout
    assert proc.returncode == 1, text + proc.stderr
    assert "notice: verify --ranks: float8.enabled=false and compile.enabled=false for the reference" in text
    assert "every run verifies on data.synthetic's random ids over all of them" in text
    assert "kept n_layers=2, n_heads=128, n_kv_heads=8, vocab_size=128256" in text
    rows = {m.group(1): (float(m.group(2)), m.group(3)) for m in re.finditer(
        r"^\| ([^|]+?) \| \d+ \|[^|]+\|[^|]+\| ([\d.e+-]+) \| ([^|]+?) \|$", text, re.M)}
    floor, _ = rows["noise floor (1 rank, TP's rounding over 2)"]
    ok, verdict = rows["tp=2,dp_shard=1"]
    assert verdict == "PASS" and 1e-4 < ok < 3 * floor, text  # past the fixed bound, within the floor's
    assert rows["tp=2,optimizer.lr=6e-5,dp_shard=1"][1] == "FAIL", text
    assert "this run's own fp32 noise is above the fixed bounds" in text


@pytest.mark.parametrize("ranks", [64, pytest.param(512, marks=pytest.mark.slow)])
def test_every_rank_of_the_405b_plan_holds_the_planners_states(ranks: int):
    """configs/405b.toml's layout -- PP 8 interleaved x TP 8 x FSDP ranks/64 -- with all 126 blocks,
    shrunk 64-fold, built on simulated ranks: every rank's parameter and optimizer-state bytes are
    the planner's for that rank's coordinates (its pp, tp and FSDP index). At 512 ranks a block's
    2-row key and value shards (8 heads of width 2 over tp 8) leave 6 of 8 FSDP ranks an empty chunk."""
    over = [f"--parallel.dp_shard={ranks // 64}", "--float8.enabled=false", "--compile.enabled=false"]
    base = load_config(ROOT / "configs" / "405b.toml", over)
    cfg = load_config(ROOT / "configs" / "405b.toml", [*over, *shrink(resolve_model(base), 64)[0]])
    got = simulated_states(cfg, ranks)
    assert sorted(got) == list(range(ranks))
    assert got == planned_states(cfg, ranks)
    assert len({v["params"] for v in got.values()}) > 2  # (stages, ends and uneven chunks differ)


def test_a_gradient_never_summed_over_dp_replicate_fails_hsdp_and_only_hsdp(tmp_path: Path, data_cache: str):
    """Planted: FSDP reduce-scatters each gradient over dp_shard, but HSDP's all-reduce over
    dp_replicate never runs. With dp_replicate=1 there is nothing to miss: dp_shard=8 passes; on
    dp_replicate=2 x dp_shard=4 each replica steps on half the batch and the layout fails.
    ``--localize`` on the same 8 simulated ranks: every output and gradient of dp_shard=8 agrees
    (each rank's capture placed by its own rows), and HSDP's first difference is a gradient."""
    proc = _faulty_verify(tmp_path, data_cache, 8, "dp_shard=8 dp_replicate=2,dp_shard=4",
                          "hsdp_skip_replicate", "--localize", steps=2)
    assert re.search(r"^\| dp_shard=8 \| 8 \|.*\| PASS \|$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\| dp_replicate=2,dp_shard=4 \| 8 \|.*\| FAIL \|$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^dp_shard=8: every module output and gradient of step 1 agrees", proc.stdout, re.M), \
        proc.stdout
    assert re.search(r"^dp_replicate=2,dp_shard=4: first difference at the gradient of output\.weight: "
                     r"relative [1-9]\.\d+e-01 ", proc.stdout, re.M), proc.stdout  # (backward's first)


def test_experts_placed_by_modulo_against_weights_cut_in_blocks_fail_only_with_two_a_rank(
        tmp_path: Path, data_cache: str):
    """Planted: the all-to-all sends expert e's tokens to rank e % ep while the weights give rank r the
    block of experts r*E/ep onwards. With one expert a rank (4 experts, ep=4) the two agree and the
    layout passes; with two (ep=2) tokens meet another expert's weights and it fails."""
    proc = _faulty_verify(tmp_path, data_cache, 4, "dp_shard=4,ep=4 dp_shard=4,ep=2", "ep_experts_by_modulo",
                          *MOE_ARGS, config="moe-debug.toml", steps=2, seq=64)
    assert re.search(r"^\| dp_shard=4,ep=4 \| 4 \|.*\| PASS \|$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\| dp_shard=4,ep=2 \| 4 \|.*\| FAIL \|$", proc.stdout, re.M), proc.stdout
    # localized: block 1's routed feed-forward (block 0 is dense), where tokens meet the wrong weights
    assert re.search(r"^dp_shard=4,ep=2: first difference at the output of layers\.1\.feed_forward: .*"
                     r"ep \(experts, in routed feed-forwards\)$", proc.stdout, re.M), proc.stdout


def _planned_405b(world: int, *degrees: str) -> Config:
    """configs/405b.toml shrunk 64-fold as ``verify --shrink`` narrows it, fp32, on random ids."""
    over = ["--float8.enabled=false", "--compile.enabled=false", "--training.mixed_precision=fp32",
            "--data.synthetic=true", "--training.seq_len=64", "--debug.deterministic=true",
            "--eval.interval=0", *degrees]
    base = load_config(ROOT / "configs" / "405b.toml", over)
    return load_config(ROOT / "configs" / "405b.toml", [*over, *shrink(resolve_model(base), 64)[0]])


COMM_LAYOUTS = {
    "tp8_fsdp8": (64, ["--parallel.pp=1", "--parallel.tp=8", "--parallel.dp_shard=8", "--model.n_layers=2",
                       "--training.global_batch=16"]),
}
SLOW_COMM_LAYOUTS = {  # (make test keeps under 30 minutes) and the plan's first choice, PP 8 x TP 8 x FSDP 8
    "pp2_interleaved_tp8_fsdp4": (64, ["--parallel.pp=2", "--parallel.tp=8", "--parallel.dp_shard=4",
                                       "--model.n_layers=4", "--training.global_batch=16"]),
    "405b_plan_512": (512, ["--parallel.pp=8", "--parallel.tp=8", "--parallel.dp_shard=8",
                            "--model.n_layers=16", "--training.global_batch=64"]),
}


@pytest.mark.parametrize("layout", [*COMM_LAYOUTS, *(pytest.param(k, marks=pytest.mark.slow)
                                                      for k in SLOW_COMM_LAYOUTS)])
def test_the_planners_collectives_are_what_the_simulated_ranks_issue(layout: str):
    """The 405B model shrunk, on 64 simulated ranks (PP 2 x TP 8 x FSDP 4 and the plan's 512 in make
    test-all): each pipeline rank's first rank issues, in the second step, the bytes per mesh dim and
    collective the planner's table gives that pipeline rank (``--debug.comm``'s measure, as
    test_plan_measured.py holds the planner to real gloo ranks)."""
    world, degrees = {**COMM_LAYOUTS, **SLOW_COMM_LAYOUTS}[layout]
    cfg = _planned_405b(world, *degrees)
    model = build_model(resolve_model(cfg), device="cpu")
    init_weights(model, cfg.training.seed)
    seed = {k: v.detach() for k, v in model.state_dict().items()}
    del model
    sim = train_simulated(cfg, world, 2, seed, seed)
    est = estimate(cfg, world, load_hardware("h100"))  # (the hardware plays no part in bytes)
    degrees_ = est.run.dims.degrees
    assert len(sim.collectives) == est.layout.pp
    for pp_rank, got in enumerate(sim.collectives):
        assert got, pp_rank
        assert by_ranks(degrees_, got) == by_ranks(degrees_, totals(list(est.collectives[pp_rank]))), pp_rank


def _faulty_verify(tmp_path: Path, data_cache: str, ranks: int, layouts: str, fault: str, *extra: str,  # noqa: ANN202
                   config: str = "debug.toml", steps: int = 1, seq: int = 128):
    """``verify --ranks`` of the layouts (space-separated) of ``configs/<config>`` with ``extra``, in
    fp32, with ``fault`` planted: it exits 1 (a layout failed)."""
    proc = run_cli(["verify", "--config", str(ROOT / "configs" / config), "--ranks", str(ranks), *extra,
                    "--layouts", *layouts.split(), "--steps", str(steps), f"--training.seq_len={seq}",
                    "--training.mixed_precision=fp32", f"--data.cache_dir={data_cache}",
                    "--out", str(tmp_path / "v")], timeout=600, check=False, fault=fault)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc
