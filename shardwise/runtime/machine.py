"""This machine: the device type, the usable cores (cgroup limits too) and the threads each rank
gets, whether this CPU multiplies bf16 natively, the compile toolchain, and the allocator settings
training wants. Imports nothing from the package but the config's error type; torch is imported by
the functions that need it, since the data-preparation workers import this module (for the core
count) and must start without loading torch."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator

from shardwise.config.types import ConfigError


def usable_cores() -> int:
    """The cores this process may run on, not the machine's count: its CPU affinity (e.g. a Slurm
    allotment), and no more than a cgroup CPU quota allows (a container given 2 CPUs of a larger
    host still lists all of the host's in its affinity)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    return max(1, min(cores, quota)) if quota else cores


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int | None:
    """Whole cores the tightest CPU quota over this process's cgroup allows (rounded up), or None
    without one: cgroup v2's ``cpu.max`` from the process's own group up to the root, or v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    import math

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    limits = []
    for line in read(own).splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: every group from this one up to the root may cap it
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                quota, _, period = read(os.path.join(root, *parts[:depth], "cpu.max")).partition(" ")
                if quota.isdigit() and period.isdigit() and int(period):
                    limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):
            for base in {path, "/"}:  # (inside a container's namespace the group shows as its root)
                d = os.path.join(root, controllers, base.lstrip("/"))
                quota, period = (read(os.path.join(d, f"cpu.cfs_{name}_us")) for name in ("quota", "period"))
                if quota.isdigit() and period.isdigit() and int(period):  # (-1: no quota)
                    limits.append(int(quota) / int(period))
    return max(1, math.ceil(min(limits) - 1e-9)) if limits else None


def fair_threads(local_ranks: int, cores: int | None = None) -> int:
    """Each of ``local_ranks`` processes' share of the usable cores, at least one thread."""
    return max(1, (cores or usable_cores()) // max(1, local_ranks))


def rank_threads(local_ranks: int) -> tuple[int, str]:
    """Intra-op threads for each of ``local_ranks`` processes on this machine: the usable cores
    shared out (at least one each), or fewer where ``OMP_NUM_THREADS`` asks for fewer; and why an
    ``OMP_NUM_THREADS`` asking for more was lowered ("" if it was not). More threads than cores
    spin: a pipeline stage's OpenMP threads keep their cores busy while the stage waits for its
    neighbour, so oversubscribed pipelines run several times slower (bench/results/history.md,
    "Pipelines on oversubscribed threads")."""
    cores = usable_cores()
    fair = fair_threads(local_ranks, cores)
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    asked = int(text) if text.isdigit() else 0  # (unset, empty or not a count: 0)
    if asked <= fair:
        return asked or fair, ""
    return fair, (f"OMP_NUM_THREADS={asked} on {local_ranks} rank(s) would run {asked * local_ranks} "
                  f"threads on {cores} usable core(s): each rank runs {fair} (threads beyond the cores spin "
                  "while a rank waits: pp=4 ran 7.6x slower with 2 threads a rank on 2 cores)")


def cap_cpu_threads(local_ranks: int) -> None:
    """Lower this process's intra-op threads to its share of the usable cores if it has more (a
    rank started by torchrun or Slurm with the machine's own OMP_NUM_THREADS, or torch's default
    of every core the host has inside a CPU quota). A lower count is left as it is."""
    import torch

    threads = fair_threads(local_ranks)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AMX or AVX512-BF16, Arm BF16); without it
    oneDNN emulates bf16 GEMMs far slower than fp32 ones."""
    import platform
    import subprocess

    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True,
                             text=True, check=False).stdout.strip()
        return out == "1"
    flags = _cpu_flags()
    if platform.machine() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def bf16_without_arithmetic(device_type: str, precision: str) -> bool:
    """Whether a ``precision`` run on ``device_type`` computes in bf16 on a CPU without bf16
    arithmetic (where shardwise.ops.cpu_bf16 runs its GEMMs and attention in fp32)."""
    return device_type == "cpu" and precision == "bf16" and not cpu_has_native_bf16()


def cpu_kind() -> str:
    """The x86 vector extensions that decide this CPU's kernels (and their rounding): ``AMX``,
    ``AVX-512``, ``AVX2``; else the machine's name (``arm64``, ...)."""
    import platform

    flags = _cpu_flags()
    for kind, flag in (("AMX", "amx_bf16"), ("AVX-512", "avx512f"), ("AVX2", "avx2")):
        if flag in flags:
            return kind
    return platform.machine()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read once per process (the planner asks for each candidate)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return frozenset(flags)


def device_type(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device=cuda but no CUDA device is visible: use run.device=cpu or auto")
    return requested


def compile_toolchain(device_type: str) -> str | None:
    """What torch.compile (inductor) is missing to build kernels for ``device_type``, or None: a C++
    compiler on CPU (``$CXX``, else g++, as inductor looks for it), triton on CUDA."""
    if device_type == "cuda":
        return None if importlib.util.find_spec("triton") else "the triton package"
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    return None if shutil.which(cxx) else f"a C++ compiler ({cxx} is not on PATH)"


def keep_freed_cpu_memory(keep: bool = True) -> bool:
    """Make glibc's malloc a caching allocator for this process: every block comes from the heap
    (no mmap per large tensor) and freed memory is kept for the next allocation instead of going
    back to the OS (no trim). A training step allocates and frees the same large tensors every
    step; with glibc's defaults each of them is a fresh mmap whose pages fault in again, a large share
    of a CPU step (bench/throughput.py measures it; bench/results/history.md). The resident size then
    stays at the step's peak, as with the CUDA caching allocator. ``keep=False`` goes back to
    glibc's default limits (mmap above 128 KiB, trim above 128 KiB). False where it does not
    apply (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # another C library (musl, macOS): leave it alone
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    mmap_max, trim = (0, 2**31 - 1) if keep else (65536, 128 * 1024)
    return bool(mallopt(m_mmap_max, mmap_max)) and bool(mallopt(m_trim_threshold, trim))


# The shape-keyed caches of CPU matrix products: oneDNN's primitives and ideep's operators
# (1024 entries each by default).


MATMUL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_matmul_caches(entries: int = 256) -> bool:
    """Cap both shape-keyed caches of CPU matrix products at ``entries`` each, unless the user set
    either; call it before the process's first matrix product. Returns whether it set them.

    MoE experts see a new row count at almost every call, and in bf16 every new shape adds an
    entry to both caches: unbounded, a rank's memory grows step after step and pays a page fault per
    new page, dearer still when ranks share the cores. The experts pad their
    groups (:func:`shardwise.models.moe.group_alignment`), which bounds the shapes to a few
    hundred; a smaller cap evicts kernels that are needed again, each rebuilt at a JIT compile's
    cost, so the cap sits above that count (BENCHMARKS.md, MoE on CPU)."""
    if any(name in os.environ for name in MATMUL_CACHE_ENV):
        return False
    for name in MATMUL_CACHE_ENV:
        os.environ[name] = str(entries)
    return True


# The CUDA caching allocator's settings (PYTORCH_ALLOC_CONF is the newer name of the same variable).


CUDA_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_cuda_segments() -> bool:
    """Let the CUDA caching allocator grow its segments in place (``expandable_segments:True``)
    instead of reserving a new fixed-size one whenever no free block fits, unless the user
    configured the allocator; call it before CUDA is first used. Returns whether it set it.

    A training step frees and reallocates blocks of many sizes and lifetimes, and fixed segments
    fragment: memory is reserved but unusable. torchtitan's published runs used this setting, and
    the planner's reserved-over-live factor (``plan.hardware.RESERVED_OVER_LIVE``) was fitted to
    them. It has run on one GPU (docs/training.md, "What runs where"); across several, not yet."""
    if any(name in os.environ for name in CUDA_ALLOC_ENV):
        return False
    os.environ[CUDA_ALLOC_ENV[0]] = "expandable_segments:True"
    return True


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """Within: this process's environment may change (a rank's setup writes variables into it); after,
    it is as it was, for a caller that goes on in the same process."""
    kept = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(kept)
