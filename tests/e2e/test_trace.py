"""Run traces through the CLI: two runs of one config on this machine are bitwise equal, and
``shardwise compare`` finds a planted one-step change at its step and module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.observe.trace import rank_path
from shardwise.runtime.machine import usable_cores
from tests.helpers import TINY_ARGS, run_cli

STEPS = ["--training.steps=4"]


def _traced(tmp: Path, name: str, *extra: str, fault: str = "") -> Path:
    trace = tmp / f"{name}.trace"
    run_cli(["train", *TINY_ARGS, *STEPS, f"--run.dir={tmp / name}", f"--data.cache_dir={tmp / 'cache'}",
             f"--debug.trace={trace}", *extra], fault=fault)
    return trace


def test_two_runs_are_bitwise_equal_and_compare_finds_a_planted_change(tmp_path: Path):
    a, b = _traced(tmp_path, "a"), _traced(tmp_path, "b")
    same = run_cli(["compare", str(a), str(b)])
    assert "bitwise equal: 4 steps" in same.stdout, same.stdout
    planted = _traced(tmp_path, "planted", fault="perturb_ffn_step3")
    found = run_cli(["compare", str(a), str(planted)], check=False)
    assert found.returncode == 1, found.stdout + found.stderr
    first = found.stdout.splitlines()[0]
    assert first.startswith("first difference: step 3, output of layers.1.feed_forward:"), found.stdout
    assert "the same up to: step 3 output of layers.1.feed_forward.w2" in found.stdout
    # with a tolerance above the perturbation's size the runs still differ after it: the loss moved
    loose = run_cli(["compare", str(a), str(planted), "--rtol", "1e-12"], check=False)
    assert loose.returncode == 1 and "step 3" in loose.stdout


@pytest.mark.slow  # (make test-all: the 1-rank test above runs the same trace code)
def test_traces_of_two_ranks_compare_rank_by_rank(tmp_path: Path):
    a = _traced(tmp_path, "a", "--nproc=2", "--parallel.dp_shard=2")
    b = _traced(tmp_path, "b", "--nproc=2", "--parallel.dp_shard=2")
    assert (tmp_path / "a.trace.rank1").is_file()
    out = run_cli(["compare", str(a), str(b)]).stdout
    assert "rank 0: bitwise equal" in out and "rank 1: bitwise equal" in out, out


def test_compare_refuses_what_is_not_a_trace(tmp_path: Path):
    bad = tmp_path / "x.trace"
    bad.write_text("not json\n")
    proc = run_cli(["compare", str(bad), str(bad)], check=False)
    assert proc.returncode == 2 and "is not a shardwise trace" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_trace_never_replaces_a_file_and_runs_eager(tmp_path: Path):
    taken = tmp_path / "taken.trace"
    taken.write_text("someone's notes\n")
    args = ["train", *TINY_ARGS, f"--run.dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    proc = run_cli([*args, f"--debug.trace={taken}"], check=False)
    assert proc.returncode == 2 and "exists and a trace never replaces one" in proc.stderr, proc.stderr
    assert taken.read_text() == "someone's notes\n"
    proc = run_cli([*args, f"--debug.trace={tmp_path / 'new.trace'}", "--compile.enabled=true"], check=False)
    assert proc.returncode == 2 and "set compile.enabled=false (or auto)" in proc.stderr, proc.stderr


@pytest.mark.dist
def test_an_oversubscribing_omp_num_threads_is_lowered_for_the_ranks(tmp_path: Path, monkeypatch):
    """OMP_NUM_THREADS=8 on 2 local ranks: the launcher says it lowers it, and each rank runs its
    share of the usable cores (the thread count its trace records)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    trace = tmp_path / "t.trace"
    proc = run_cli(["train", *TINY_ARGS, "--training.steps=2", f"--run.dir={tmp_path / 'run'}",
                    f"--data.cache_dir={tmp_path / 'cache'}", f"--debug.trace={trace}", "--nproc=2",
                    "--parallel.dp_shard=2"])
    share = max(1, usable_cores() // 2)
    assert "notice: OMP_NUM_THREADS=8 on 2 rank(s) would run 16 threads" in proc.stdout, proc.stdout
    assert f"each rank runs {share}" in proc.stdout
    for rank in (0, 1):
        header = json.loads(rank_path(trace, rank).read_text().splitlines()[0])
        assert header["threads"] == share, header


@pytest.mark.dist
def test_torchrun_ranks_with_an_oversubscribing_omp_num_threads_run_their_share(tmp_path: Path, monkeypatch):
    """The same under torch's own launcher: torchrun passes OMP_NUM_THREADS=8 to its 2 ranks as it
    is; the ranks say they lower it and run their share of the usable cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    trace = tmp_path / "t.trace"
    proc = run_cli(["train", *TINY_ARGS, "--training.steps=2", f"--run.dir={tmp_path / 'run'}",
                    f"--data.cache_dir={tmp_path / 'cache'}", f"--debug.trace={trace}",
                    "--parallel.dp_shard=2"],
                   launcher=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                             "shardwise"])
    share = max(1, usable_cores() // 2)
    assert "notice: OMP_NUM_THREADS=8 on 2 rank(s) would run 16 threads" in proc.stdout, proc.stdout
    for rank in (0, 1):
        header = json.loads(rank_path(trace, rank).read_text().splitlines()[0])
        assert header["threads"] == share, header
