"""FLOPs per token, device peaks (table, override, measured and cached) and MFU arithmetic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from shardwise.models import PRESETS, build_model
from shardwise.observe import peak as peak_mod
from shardwise.observe.flops import flops_per_token, num_params
from shardwise.observe.metrics import Throughput


def test_flops_per_token_palm_convention():
    a = PRESETS["debug"]
    n = sum(p.numel() for name, p in build_model(a).named_parameters() if name != "tok_embeddings.weight")
    assert flops_per_token(a, 2048) == 6 * n + 12 * a.n_layers * a.dim * 2048


def test_tied_embedding_counts_once_as_the_output_matmul():
    a = PRESETS["1b"]
    assert num_params(a) == sum(p.numel() for p in build_model(a).parameters())
    assert flops_per_token(a, 1) == 6 * num_params(a) + 12 * a.n_layers * a.dim


@pytest.mark.parametrize("name,row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA B200", "B200"), ("AMD Instinct MI300X", "MI300X"), ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names_map_to_the_right_peak_row(name: str, row: str | None):
    assert peak_mod.gpu_peak_name(name) == row


def test_override_wins():
    assert peak_mod.peak_tflops(torch.device("cpu"), "bf16", override=123.0) == (123.0, "metrics.peak_tflops")


def test_cpu_peak_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def fake_measure(dtype, device, n=2048, seconds=1.0):
        calls.append((dtype, n))
        return 0.5 if n == 1024 else 0.7

    monkeypatch.setattr(peak_mod, "measure_gemm_tflops", fake_measure)
    value, source = peak_mod.peak_tflops(torch.device("cpu"), "fp32", cache_dir=str(tmp_path))
    assert value == 0.7 and "measured fp32 GEMM" in source
    assert peak_mod.peak_tflops(torch.device("cpu"), "fp32", cache_dir=str(tmp_path))[0] == 0.7
    assert len(calls) == 2  # two sizes, measured once; the second call read the cache
    cache = json.loads((tmp_path / "peak_tflops.json").read_text())
    assert any("threads=" in k and "fp32" in k for k in cache)


def test_real_gemm_measurement_is_positive():
    assert peak_mod.measure_gemm_tflops(torch.float32, torch.device("cpu"), n=128, seconds=0.05) > 0


def test_throughput_mfu_arithmetic(monkeypatch: pytest.MonkeyPatch):
    clock = itertools.chain([0.0], itertools.repeat(2.0))  # start, then 2 s later (and the reset)
    monkeypatch.setattr("shardwise.observe.metrics.time.perf_counter", lambda: next(clock))
    t = Throughput(flops_per_token=1e9, peak_tflops=1.0, world_size=2)
    t.add(1000)
    t.add(1000)
    w = t.window()
    assert w["tokens_per_s"] == 1000 and w["tokens_per_s_per_device"] == 500
    assert w["step_time_s"] == 1.0 and w["mfu"] == pytest.approx(500 * 1e9 / 1e12)
