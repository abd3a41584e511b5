"""Peak dense FLOP/s of the device MFU is measured against.

GPUs are looked up by name in a table of published dense peaks. A CPU, or a GPU not in the table,
gets a measured GEMM peak (cached per machine, thread count, dtype and torch version). There is no
silent fallback to another device's peak: ``metrics.peak_tflops`` overrides everything.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.ops.cpu_bf16 import fp32_gemms_for_bf16

# Dense (no sparsity) peak TFLOP/s per dtype, from the vendors' data sheets.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp8": 1671.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp8": 0.0, "fp32": 19.5},
    "MI300X": {"bf16": 1307.0, "fp8": 2615.0, "fp32": 163.4},
}


def gpu_peak_name(device_name: str) -> str | None:
    """Match a ``torch.cuda.get_device_name()`` string to a GPU_PEAKS row (None if unknown)."""
    n = device_name.upper()
    if "H100" in n:
        if "PCIE" in n:
            return "H100 PCIe"
        return "H100 NVL" if "NVL" in n else "H100 SXM"
    for key in ("H200", "B200", "A100", "MI300X"):
        if key in n:
            return key
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_gemm_tflops(dtype: torch.dtype, device: torch.device, n: int = 2048,
                        seconds: float = 1.0, products: tuple = (F.linear, torch.matmul)) -> float:
    """Best sustained TFLOP/s of square n x n products on ``device`` over about ``seconds``, in
    both layouts a linear layer runs (``products``): ``a @ b.T`` (its forward) and ``a @ b`` (its
    input gradient).
    They can differ tenfold: on CPUs without native bf16, bf16 ``a @ b`` ran at 0.0008-0.0014
    TFLOP/s and ``a @ b.T`` at 0.012-0.017 (2 cores, AVX2), so a peak from one layout alone put
    a bf16 run's MFU at 240%."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    for product in products:
        product(a, b)
        sync()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            t0 = time.perf_counter()
            for _ in range(4):
                product(a, b)
            sync()
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0) / 1e12)
    return best


def measure_peak(dtype: torch.dtype, device: torch.device, budget_s: float = 1.0) -> float:
    """Best TFLOP/s over square GEMMs of 256, 512, 1024 and 2048, in that order.

    Small GEMMs can beat large ones on CPUs whose caches favour them, and large ones beat small
    ones where packing and call overhead dominate, so the best of all sizes (for a GPU not in the
    table too) is the peak. A size is left out when the best rate so far
    puts one product over ``budget_s``: a CPU without native bf16 emulates it at about 0.001-0.003
    TFLOP/s, where one 2048 product takes 6-17 s. Since rates grow with size on such CPUs, the
    prediction errs long and only sizes that really are slow are dropped."""
    best = 0.0
    for n in (256, 512, 1024, 2048):
        if best and 2 * n**3 / (best * 1e12) > budget_s:
            break
        best = max(best, measure_gemm_tflops(dtype, device, n, seconds=0.3 if n < 1024 else 1.0))
    return best


def peak_tflops(device: torch.device, mixed_precision: str, override: float = 0.0,
                cache_dir: str = "~/.cache/shardwise") -> tuple[float, str]:
    """(peak TFLOP/s, where the figure came from) for one device of this run."""
    if override > 0:
        return override, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        row = gpu_peak_name(name)
        if row is not None:
            return GPU_PEAKS[row][mixed_precision], f"{row} data sheet"
        label = f"cuda|{name}"
    else:
        label = f"cpu|{cpu_name()}|threads={torch.get_num_threads()}"
    # (method=2: both product layouts; figures cached before it measured one, too low on some CPUs.
    # bf16 GEMMs run as fp32 ones on a CPU without bf16 arithmetic (ops/cpu_bf16.py): another peak)
    gemms = "|fp32-gemms" if mixed_precision == "bf16" and fp32_gemms_for_bf16() else ""
    key = f"{label}|{mixed_precision}{gemms}|torch={torch.__version__}|method=2"
    path = Path(cache_dir).expanduser() / "peak_tflops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
        cache[key] = measure_peak(dtype, device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return cache[key], f"measured {mixed_precision} GEMM ({label})"
