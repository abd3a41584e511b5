"""Every layout is the same training run as one rank (gloo, fp32, deterministic).

Each layout trains 10 steps from the same seed on the same global batch of 8 sequences; per-step
loss and gradient norm, and the final parameters, must match the single-rank run (fp32; the only
differences are summation orders in collectives and in tensor-parallel matmuls). Tolerances:

- loss and grad norm: max relative difference 1e-5 per step;
- parameters: for every tensor, ||p_layout - p_ref|| <= 1e-4 * ||p_ref - p_init||, i.e. the
  training displacement agrees to 0.01%. (An element-wise bound does not fit Adam: for entries whose
  gradient is near zero, m / sqrt(v) turns rounding-level gradient differences into update
  differences of up to ~lr per step. TP's row-parallel matmuls reach 2.4e-5 absolute on such
  embedding entries while the tensor-level error is 1.5e-5 of the update.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.data.tokenizer import SHIPPED_CORPUS
from shardwise.verify.parity import checkpoint_params
from tests.helpers import (
    DEEPSEEK_ARGS,
    DEEPSEEK_LAYOUTS,
    LAYOUTS,
    LOSS_RTOL,
    MOE_ARGS,
    MOE_LAYOUTS,
    MULTI_STAGE,
    MULTI_STAGE_LAYOUTS,
    PARAM_RTOL,
    QWEN3_ARGS,
    QWEN3_LAYOUTS,
    QWEN3_UNMASKED_LAYOUTS,
    UNMASKED_LAYOUTS,
    check_layout_ran,
    check_same_run,
    layouts,
    max_rel,
    metrics,
    param_error,
    parity_run,
)

pytestmark = pytest.mark.dist

# The extended matrix: further combinations whose parts CI already covers (each parallelism, and
# each memory switch in some multi-rank layout). They run with `make test-all` (CI's 30-minute
# budget on a 2-core machine does not fit them all).
SLOW = {"fsdp4", "hsdp2_tp2", "cp2_no_load_balance_alltoall", "cp4", "hsdp2_cp2", "moe_fsdp2",
        "moe_fsdp4_ep2", "moe_tp2", "moe_ep4_tp2", "moe_hsdp2_ep2", "pp2_interleaved",
        "pp2_interleaved_tp2", "pp2_zbv", "pp2_dualpipev", "fsdp2_ac_selective", "tp2_ac_full",
        "fsdp2_chunked_loss", "cp2_ac_selective", "fsdp2_tp2_chunked_loss", "fsdp2_tp2_ac_layer",
        "pp2_cp2", "cp2_tp2", "tp2_gathered_logits", "fsdp2_gloo_override", "pp2_tp2",
        "moe_ep2_ac_selective_half", "ds_fsdp2", "ds_tp2", "ds_ep2", "ds_pp2",
        # covered in CI by a larger case of the same kind: the accumulation test, pp2_fsdp2_tp2 (also
        # for 1F1B), moe_cp2_ep2_chunked_loss, fsdp2_tp2 and tp2_ac_selective_half, fsdp2_cp2 (and
        # verify's cp=2), moe_ep2_tp2
        "fsdp2_accum2", "pp2_fsdp2", "moe_cp2_ep2", "tp2", "cp2", "pp2_1f1b", "moe_ep2",
        # document masks under cp: cp2_docs, cp2_tp2_docs and pp2_cp2_docs in CI; one contiguous
        # chunk per rank also in test_model.py's pieces test
        "cp4_docs", "fsdp2_cp2_docs", "cp2_docs_no_load_balance"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref"), "ref", data_cache)


@pytest.fixture(scope="module")
def reference_moe(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref_moe"), "ref", data_cache, *MOE_ARGS)


@pytest.mark.parametrize("layout", layouts(MOE_LAYOUTS, SLOW))
def test_moe_layout_matches_single_rank(layout: str, reference_moe: Path, tmp_path: Path, data_cache: str):
    """Expert parallel alone and with FSDP, HSDP, TP, CP and PP; the expert load each step (from
    counts summed over all ranks) is the reference's too."""
    run_dir = parity_run(tmp_path, layout, data_cache, *MOE_ARGS, *MOE_LAYOUTS[layout])
    check_same_run(reference_moe, run_dir, layout, MOE_LAYOUTS[layout])
    loads = [r["expert_load"] for r in metrics(run_dir)]
    assert loads == pytest.approx([r["expert_load"] for r in metrics(reference_moe)], rel=1e-6)


def test_moe_bias_balancing_sigmoid_matches_single_rank(tmp_path: Path, data_cache: str):
    """Auxiliary-loss-free balancing (routing bias updated from global counts) with sigmoid scores:
    the same run on 1 rank and on EP2 x TP2."""
    extra = [*MOE_ARGS, "--model.moe_balance=bias", "--model.moe_score=sigmoid", "--model.moe_bias_rate=0.01"]
    ref = parity_run(tmp_path, "ref", data_cache, *extra)
    layout = ["--nproc=4", "--parallel.ep=2", "--parallel.tp=2"]
    check_same_run(ref, parity_run(tmp_path, "ep2_tp2", data_cache, *extra, *layout), "bias ep2_tp2", layout)


def test_moe_batch_balance_loss_matches_single_rank(tmp_path: Path, data_cache: str):
    """The balance loss over the whole batch (its expert shares all-reduced over the ranks that route
    other tokens): the same run on 1 rank and on FSDP2 x CP2, whose ranks each hold half of half the
    batch's sequences."""
    extra = [*MOE_ARGS, "--model.moe_aux_scope=batch", "--model.moe_aux_coef=0.3"]
    ref = parity_run(tmp_path, "ref", data_cache, *extra)
    layout = ["--nproc=4", "--parallel.cp=2"]
    check_same_run(ref, parity_run(tmp_path, "fsdp2_cp2", data_cache, *extra, *layout),
                   "batch balance loss fsdp2_cp2", layout)


def test_moe_router_z_loss_matches_single_rank(tmp_path: Path, data_cache: str):
    """The router z-loss (a mean over the step's tokens) when CP x TP split each sequence over four
    ranks: the same run as on one rank."""
    extra = [*MOE_ARGS, "--model.moe_z_coef=0.05"]
    ref = parity_run(tmp_path, "ref", data_cache, *extra)
    layout = ["--nproc=4", "--parallel.cp=2", "--parallel.tp=2"]
    run_dir = parity_run(tmp_path, "cp2_tp2", data_cache, *extra, *layout)
    check_same_run(ref, run_dir, "z-loss cp2_tp2", layout)


@pytest.fixture(scope="module")
def reference_deepseek(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref_deepseek"), "ref", data_cache, *DEEPSEEK_ARGS)


LOW_RANK_Q = [k for k in DEEPSEEK_LAYOUTS if "full_q" not in k]


@pytest.mark.parametrize("layout", layouts({k: DEEPSEEK_LAYOUTS[k] for k in LOW_RANK_Q}, SLOW))
def test_deepseek_layout_matches_single_rank(layout: str, reference_deepseek: Path, tmp_path: Path,
                                             data_cache: str):
    """DeepSeek-V3: latent attention under FSDP, TP (expansions split by heads, compressions whole),
    CP (ring attention with values narrower than the keys), PP, and its group-limited sigmoid
    routing under EP and EP x FSDP x TP; the expert load each step is the reference's."""
    run_dir = parity_run(tmp_path, layout, data_cache, *DEEPSEEK_ARGS, *DEEPSEEK_LAYOUTS[layout])
    check_same_run(reference_deepseek, run_dir, layout, DEEPSEEK_LAYOUTS[layout])
    loads = [r["expert_load"] for r in metrics(run_dir)]
    assert loads == pytest.approx([r["expert_load"] for r in metrics(reference_deepseek)], rel=1e-6)


def test_deepseek_full_queries_cp2_tp2_match_single_rank(tmp_path: Path, data_cache: str):
    """Latent attention with a full query projection (DeepSeek-V3 16B's) under CP x TP."""
    extra = [*DEEPSEEK_ARGS, "--model.q_lora_rank=0"]
    ref = parity_run(tmp_path, "ref", data_cache, *extra)
    layout = [a for a in DEEPSEEK_LAYOUTS["ds_cp2_tp2_full_q"] if a != "--model.q_lora_rank=0"]
    run_dir = parity_run(tmp_path, "cp2_tp2", data_cache, *extra, *layout)
    check_same_run(ref, run_dir, "full-q cp2_tp2", layout)


@pytest.fixture(scope="module")
def reference_unmasked(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref_unmasked"), "ref", data_cache,
                      "--data.document_mask=false")


@pytest.mark.parametrize("layout", layouts(UNMASKED_LAYOUTS, SLOW))
def test_unmasked_layout_matches_single_rank(layout: str, reference_unmasked: Path, tmp_path: Path,
                                             data_cache: str):
    run_dir = parity_run(tmp_path, layout, data_cache, "--data.document_mask=false",
                         *UNMASKED_LAYOUTS[layout])
    check_same_run(reference_unmasked, run_dir, layout, UNMASKED_LAYOUTS[layout])


@pytest.fixture(scope="module")
def reference_qwen3(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref_qwen3"), "ref", data_cache, *QWEN3_ARGS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(QWEN3_UNMASKED_LAYOUTS))
def test_qwen3_unmasked_layout_matches_single_rank(layout: str, tmp_path: Path, data_cache: str):
    extra = [*QWEN3_ARGS, "--data.document_mask=false"]
    ref = parity_run(tmp_path, "ref", data_cache, *extra)
    run_dir = parity_run(tmp_path, layout, data_cache, *extra, *QWEN3_UNMASKED_LAYOUTS[layout])
    check_same_run(ref, run_dir, layout, QWEN3_UNMASKED_LAYOUTS[layout])


@pytest.mark.parametrize("layout", layouts(QWEN3_LAYOUTS, {"qwen3_fsdp2_tp2", "qwen3_fsdp2"}))
def test_qwen3_layout_matches_single_rank(layout: str, reference_qwen3: Path, tmp_path: Path,
                                          data_cache: str):
    run_dir = parity_run(tmp_path, layout, data_cache, *QWEN3_ARGS, *QWEN3_LAYOUTS[layout])
    check_same_run(reference_qwen3, run_dir, layout, QWEN3_LAYOUTS[layout])


@pytest.fixture(scope="module")
def reference_4_layers(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref4"), "ref", data_cache, *MULTI_STAGE)


@pytest.mark.parametrize("layout", layouts(MULTI_STAGE_LAYOUTS, SLOW))
def test_multi_stage_pipeline_matches_single_rank(layout: str, reference_4_layers: Path, tmp_path: Path,
                                                  data_cache: str):
    run_dir = parity_run(tmp_path, layout, data_cache, *MULTI_STAGE, *MULTI_STAGE_LAYOUTS[layout])
    assert sum("val_loss" in r for r in metrics(run_dir)) == 2
    check_same_run(reference_4_layers, run_dir, layout, MULTI_STAGE_LAYOUTS[layout])


@pytest.mark.parametrize("layout", layouts(LAYOUTS, SLOW))
def test_layout_matches_single_rank(layout: str, reference: Path, tmp_path: Path, data_cache: str):
    run_dir = parity_run(tmp_path, layout, data_cache, *LAYOUTS[layout])
    check_same_run(reference, run_dir, layout, LAYOUTS[layout])


def test_torchrun_entry_point(reference: Path, tmp_path: Path, data_cache: str):
    """The same command under torch's own launcher (torchrun) is the same run."""
    run_dir = parity_run(tmp_path, "torchrun", data_cache, launcher=[
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "shardwise"])
    losses = [r["loss"] for r in metrics(run_dir)]
    assert max_rel(losses, [r["loss"] for r in metrics(reference)]) <= LOSS_RTOL
    check_layout_ran(run_dir, ["--nproc=2"], "torchrun")


def test_a_dropped_parallelism_matches_on_numbers_and_is_caught_by_its_shards(reference: Path, tmp_path: Path,
                                                                             data_cache: str):
    """Tensor parallel never applied on a tp=2 mesh (the ``skip_tp`` fault: every tp rank runs the
    whole model on the same batch) trains the one-rank run to within parity's tolerances -- losses,
    norms and parameters cannot tell -- and the layout check fails it, naming what was not split."""
    layout = ["--nproc=2", "--parallel.tp=2"]
    run_dir = parity_run(tmp_path, "tp2_skipped", data_cache, *layout, fault="skip_tp")
    got, ref = metrics(run_dir), metrics(reference)
    assert max_rel([r["loss"] for r in got], [r["loss"] for r in ref]) <= LOSS_RTOL
    assert max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref]) <= LOSS_RTOL
    assert param_error(reference, run_dir) <= PARAM_RTOL
    with pytest.raises(AssertionError, match=r"attention\.wo\.weight split 1 ways along its input dim"):
        check_layout_ran(run_dir, layout, "tp2")


def test_gradient_accumulation_4x1_equals_1x4(tmp_path: Path, data_cache: str):
    """One rank: 4 micro-batches of 1 sequence == 1 micro-batch of 4 sequences."""
    common = ["--training.global_batch=4"]
    one = parity_run(tmp_path, "mb4", data_cache, *common, "--training.micro_batch=4")
    four = parity_run(tmp_path, "mb1", data_cache, *common, "--training.micro_batch=1")
    diff = max_rel([r["loss"] for r in metrics(four)], [r["loss"] for r in metrics(one)])
    assert diff <= LOSS_RTOL, f"accumulation loss max rel diff {diff:.2e}"
    assert param_error(one, four) <= PARAM_RTOL


# (CI: the two-rank mixed-source and chat runs; the plain ones on one and two ranks in make test-all)
@pytest.mark.parametrize("nproc,mixed,chat", [pytest.param(1, False, False, marks=pytest.mark.slow),
                                              pytest.param(2, False, False, marks=pytest.mark.slow),
                                              (2, True, False), (2, False, True)])
def test_resume_continues_the_same_run(tmp_path: Path, data_cache: str, nproc: int, mixed: bool, chat: bool):
    """Stop after step 4 and resume: steps 5..10 are bit-identical to the uninterrupted run. Mixed:
    two weighted sources, the small one going round its epochs several times. Chat: the shipped chat
    set, the loss on assistant tokens."""
    layout = [f"--nproc={nproc}"] if nproc > 1 else []
    if chat:
        layout.append("--data.format=chat")
    if mixed:
        small = tmp_path / "small.jsonl"
        small.write_text("\n".join(json.dumps({"text": f"Psalm {i}: " + "praise ye the Lord. " * 8})
                                   for i in range(12)))
        layout.append(f"--data.sources=path={SHIPPED_CORPUS},weight=3;path={small},weight=1,name=small")
    full = parity_run(tmp_path, "full", data_cache, *layout, "--checkpoint.interval=4")
    # The interrupted run: everything the full run had on disk right after its step-4 save.
    part = tmp_path / "part"
    shutil.copytree(full / "checkpoints" / "step-4", part / "checkpoints" / "step-4")
    parity_run(tmp_path, "part", data_cache, *layout, "--checkpoint.resume=true", "--checkpoint.interval=4")
    want, got = metrics(full), metrics(part)
    assert [r["step"] for r in got] == list(range(5, 11))
    for a, b in zip(want[4:], got, strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), a["step"]
        if mixed:
            assert a["data/small_share"] == b["data/small_share"] == 0.25
            assert a["data/small_epoch"] == b["data/small_epoch"]
    assert not mixed or want[-1]["data/small_epoch"] > 2
    p_full, p_part = (checkpoint_params(d / "checkpoints" / "step-10") for d in (full, part))
    assert p_full.keys() == p_part.keys()
    for k in p_full:  # the final parameters too, bit for bit
        assert torch.equal(p_full[k], p_part[k]), k
