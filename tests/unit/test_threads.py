"""Threads per local rank: never more threads than usable cores (an OMP_NUM_THREADS asking for more
is lowered, with the reason), and a cgroup CPU quota counts as the cores' limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.launch import process
from shardwise.runtime import machine as device


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_threads_share_the_cores_and_an_oversubscribing_request_is_lowered(two_cores, monkeypatch):
    assert device.rank_threads(1) == (2, "") and device.rank_threads(4) == (1, "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert device.rank_threads(1) == (1, "")  # fewer than the share: kept
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads, why = device.rank_threads(4)
    assert threads == 1 and why.startswith("OMP_NUM_THREADS=2 on 4 rank(s) would run 8 threads on 2 usable")
    assert "each rank runs 1" in why and "\n" not in why
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert device.rank_threads(2) == (1, "")


def test_the_launcher_gives_ranks_the_lowered_count(two_cores, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # (set_rank_env sets it when unset; restored after)
    process.set_rank_env(2, 0)
    assert process.os.environ["OMP_NUM_THREADS"] == "1"


def test_a_rank_with_more_threads_than_its_share_is_capped(two_cores):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        device.cap_cpu_threads(2)
        assert torch.get_num_threads() == 1
        device.cap_cpu_threads(1)  # never raised
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_quotas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    own = tmp_path / "self_cgroup"
    # v2: the tightest quota from the process's group up to the root, rounded up to whole cores
    _write(own, "0::/a/b\n")
    _write(tmp_path / "v2" / "a" / "b" / "cpu.max", "max 100000\n")
    _write(tmp_path / "v2" / "a" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "v2" / "cpu.max", "400000 100000\n")
    assert device.cgroup_cpu_limit(str(tmp_path / "v2"), str(own)) == 2
    # v1: the cpu controller's own group and its root; -1 is no quota
    _write(own, "4:memory:/m\n3:cpu,cpuacct:/x\n")
    _write(tmp_path / "v1" / "cpu,cpuacct" / "x" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "v1" / "cpu,cpuacct" / "x" / "cpu.cfs_period_us", "100000\n")
    assert device.cgroup_cpu_limit(str(tmp_path / "v1"), str(own)) is None
    _write(tmp_path / "v1" / "cpu,cpuacct" / "cpu.cfs_quota_us", "300000\n")
    _write(tmp_path / "v1" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert device.cgroup_cpu_limit(str(tmp_path / "v1"), str(own)) == 3
    assert device.cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "missing")) is None
    # a quota below the affinity is the limit
    monkeypatch.setattr(device, "cgroup_cpu_limit", lambda: 1)
    assert device.usable_cores() == 1


def test_a_lower_thread_count_is_left_and_odd_cgroup_lines_are_skipped(two_cores, monkeypatch, tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (read by OpenMP at start-up, not here)
        device.cap_cpu_threads(1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    _write(tmp_path / "self_cgroup", "garbage\n0::/\n")
    _write(tmp_path / "cpu.max", "200000 100000\n")
    assert device.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "self_cgroup")) == 2
