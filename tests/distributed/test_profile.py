"""Profiler traces: one file per rank and window, named rank{R}_step{S}.json, each a Chrome trace;
and the per-rank figures (step time, memory) with the straggler report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import TINY_ARGS, metrics, run_cli

pytestmark = pytest.mark.dist


def test_traces_are_named_by_rank_and_step(tmp_path: Path, data_cache: str):
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path}", "--nproc=2",
             "--training.steps=6", "--profile.enabled=true", "--profile.every=3", "--profile.warmup=1",
             "--profile.active=1"])
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    # Windows of 3 steps from step 1, each recording its last step.
    assert traces == ["rank0_step3.json", "rank0_step6.json", "rank1_step3.json", "rank1_step6.json"]
    for name in traces:
        events = json.loads((tmp_path / "traces" / name).read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any("ProfilerStep#" in n for n in names), name  # the recorded step is in the trace
        assert any("aten::mm" in n or "aten::addmm" in n for n in names), name  # and its matmuls
        assert any("all_reduce" in n or "reduce_scatter" in n or "all_gather" in n for n in names), name

    rows = metrics(tmp_path)
    for r in rows:
        assert len(r["step_time_s_per_rank"]) == 2 and len(r["memory_gib_per_rank"]) == 2
        assert r["step_time_s_per_rank"][0] == pytest.approx(r["step_time_s"])  # rank 0 logs its own
        assert r["straggler_ratio"] >= 1.0 and r["slowest_rank"] in (0, 1)
        times = r["step_time_s_per_rank"]
        assert r["straggler_ratio"] == pytest.approx(max(times) / sorted(times)[0])  # median of 2: lower


def test_profiling_a_short_run_records_its_last_steps(tmp_path: Path, data_cache: str):
    """`--profile.enabled true` alone on a run shorter than the 50-step windows: the window moves to
    the run's last steps, with one notice, instead of recording nothing."""
    proc = run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path}",
                    "--training.steps=4", "--profile.enabled=true"])
    assert proc.stdout.count("notice: profile: the first window would record steps 49-50, after "
                             "training.steps=4: recording steps 3-4") == 1
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["rank0_step4.json"]
    events = json.loads((tmp_path / "traces" / "rank0_step4.json").read_text())["traceEvents"]
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= {e.get("name", "") for e in events}  # (0-based)


def test_memory_breakdown_counts_every_tensor(tmp_path: Path, data_cache: str):
    """First-step breakdown: FSDP shards params/grads/optimizer states exactly in two (Adam: two fp32
    moments per parameter); activations depend on the sequences per micro-batch alone (FSDP's half
    of the batch per rank saves what accumulation's half-size micro-batch saves) and grow with them
    linearly (8, 4 and 2 sequences), over a part that does not grow (the loss's chunks)."""
    from shardwise.models import model_args
    from shardwise.models.transformer import build_model
    from shardwise.resolve.checks import load_config

    def breakdown(name: str, *extra: str) -> dict:
        run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path / name}",
                 "--training.steps=1", "--lr_scheduler.warmup_steps=0", *extra])
        return json.loads((tmp_path / name / "memory_breakdown.json").read_text())

    one, fsdp2, accum2 = breakdown("one"), breakdown("fsdp2", "--nproc=2"), breakdown(
        "accum2", "--training.micro_batch=4")
    accum4 = breakdown("accum4", "--training.micro_batch=2")
    model = build_model(model_args(load_config(tmp_path / "one" / "config.toml").model))
    total = 4 * sum(p.numel() for p in model.parameters()) / 2**30  # fp32, GiB
    assert one["params_per_rank"] == [pytest.approx(total)]
    assert sum(fsdp2["params_per_rank"]) == pytest.approx(total)  # every element on exactly one rank
    for b in (one, fsdp2):
        assert b["grads_per_rank"] == pytest.approx(b["params_per_rank"])
        assert b["optimizer_per_rank"] == pytest.approx([2 * p for p in b["params_per_rank"]])
    act = one["activations_per_rank"][0]
    assert act > 0
    half, quarter = accum2["activations_per_rank"][0], accum4["activations_per_rank"][0]
    assert 0.45 * act < half < 0.6 * act
    assert act - half == pytest.approx(2 * (half - quarter), rel=0.05)  # linear in the micro-batch
    assert fsdp2["activations_per_rank"][0] == pytest.approx(half, rel=0.05)
