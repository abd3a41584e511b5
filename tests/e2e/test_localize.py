"""``verify`` localizes a failing layout: planted bugs, each named at its module, and correct layouts
never blamed (shardwise/observe/capture.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import (
    LAYOUTS,
    MOE_ARGS,
    MOE_LAYOUTS,
    MULTI_STAGE,
    MULTI_STAGE_LAYOUTS,
    QWEN3_ARGS,
    QWEN3_LAYOUTS,
    QWEN3_UNMASKED_LAYOUTS,
    ROOT,
    TINY_ARGS,
    UNMASKED_LAYOUTS,
    as_verify_layout,
    run_cli,
)

_RUN_ONLY = ("--training.steps", "--eval.", "--checkpoint.", "--metrics.", "--debug.")  # (verify sets these)
BASE = ["verify", *[a for a in TINY_ARGS if not a.startswith(_RUN_ONLY)], "--steps=2"]
VERIFY = [*BASE, "--data.document_mask=false"]  # (pipeline and context parallel are causal-only)
MOE = ["verify", "--config", "configs/moe-debug.toml", "--steps=2", "--training.mixed_precision=fp32",
       "--data.document_mask=false", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
       "--model.n_kv_heads=2", "--model.moe_hidden_dim=32", "--model.n_experts=4", "--training.seq_len=64"]


def _localized(stdout: str) -> dict[str, str]:
    """Layout -> the first line localize printed for it."""
    lines = stdout.split("\nlocalizing:", 1)[1].splitlines()[1:]
    return {ln.split(": ", 1)[0]: ln.split(": ", 1)[1] for ln in lines if ln and not ln.startswith(" ")}


@pytest.mark.parametrize("fault,layout,first", [
    ("tp_forget_reduction", "tp=2", "first difference at the output of layers.1.feed_forward.w2:"),
    pytest.param("cp_skip_hop", "cp=2", "first difference at the output of layers.1.attention.wo:",
                 marks=pytest.mark.slow),
    pytest.param("ep_wrong_rank", "dp_shard=2,ep=2",
                 "first difference at the output of layers.1.feed_forward:", marks=pytest.mark.slow),
    ("fsdp_unit_grad_scale", "dp_shard=2", "first difference at the gradient of layers.1."),
    pytest.param("pp_wrong_microbatch", "pp=2,training.micro_batch=2",
                 "first difference at the output of tok_embeddings:", marks=pytest.mark.slow),
])
def test_a_planted_bug_is_named_at_its_module(fault: str, layout: str, first: str, tmp_path: Path,
                                              data_cache: str):
    base = MOE if "ep=" in layout else VERIFY
    proc = run_cli([*base, f"--data.cache_dir={data_cache}", "--layouts", layout, "--out", str(tmp_path)],
                   check=False, fault=fault)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _localized(proc.stdout)[layout].startswith(first), proc.stdout[-2000:]


@pytest.mark.slow  # (make test-all: make test keeps within its time on 2 cores)
def test_correct_layouts_are_never_blamed(tmp_path: Path, data_cache: str):
    """Every parallelism once (the whole fp32 matrix: make test-all, below)."""
    layouts = ["tp=2,dp_shard=2", "pp=2,cp=2,training.micro_batch=4"]
    proc = run_cli([*VERIFY, f"--data.cache_dir={data_cache}", "--layouts", *layouts, "--localize",
                    "--out", str(tmp_path / "dense")])
    moe = run_cli([*MOE, f"--data.cache_dir={data_cache}", "--layouts", "tp=2,ep=2", "--localize",
                   "--out", str(tmp_path / "moe")])
    found = {**_localized(proc.stdout), **_localized(moe.stdout)}
    assert len(found) == 3, proc.stdout[-2000:] + moe.stdout[-2000:]
    for layout, line in found.items():
        assert line.startswith("every module output and gradient of step 1 agrees within 0.0001"), \
            (layout, line)


UNMASKED = ["--data.document_mask=false"]
MATRIX = {"dense": ([], LAYOUTS), "unmasked": (UNMASKED, UNMASKED_LAYOUTS), "moe": (MOE_ARGS, MOE_LAYOUTS),
          "qwen3": (QWEN3_ARGS, QWEN3_LAYOUTS),
          "qwen3_unmasked": ([*QWEN3_ARGS, *UNMASKED], QWEN3_UNMASKED_LAYOUTS),
          "multi_stage": (MULTI_STAGE, MULTI_STAGE_LAYOUTS)}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(MATRIX))
def test_every_layout_of_the_fp32_parity_matrix_is_blameless(group: str, tmp_path: Path, data_cache: str):
    """The localizer over every layout of tests/distributed/test_parity.py's fp32 matrix (those a
    verify layout can write: not the backend override) names no module."""
    extra, table = MATRIX[group]
    layouts = [x for x in map(as_verify_layout, table.values()) if x]
    proc = run_cli([*BASE, *extra, f"--data.cache_dir={data_cache}", "--localize", "--out", str(tmp_path),
                    "--layouts", *layouts], timeout=3000)
    found = _localized(proc.stdout)
    assert len(found) == len(layouts), proc.stdout[-3000:]
    blamed = {k: v for k, v in found.items() if not v.startswith("every module output and gradient")}
    assert blamed == {}, blamed


def test_the_status_page_counts_the_matrix_as_it_is():
    """docs/status.md's localize row says how many layouts the test above runs."""
    count = sum(len([x for x in map(as_verify_layout, table.values()) if x]) for _, table in MATRIX.values())
    rows = (ROOT / "docs" / "status.md").read_text().splitlines()
    row = next(ln for ln in rows if "`verify` localizes" in ln)
    assert re.search(r"the (\d+) layouts of the fp32 matrix", row).group(1) == str(count), (count, row)
