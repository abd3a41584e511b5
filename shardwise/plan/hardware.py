"""Hardware profiles: what one device computes, holds and moves, and how devices are connected.

Profiles are TOML files (``shardwise/plan/hardware/<name>.toml``, vendors' data sheets with the
sources named in each file) for H100 SXM, H200, A100-80GB, B200 and MI300X. ``local`` -- this
machine -- is measured by ``shardwise calibrate`` (GEMM and attention throughput per dtype, memory
bandwidth, gloo collective bandwidth and latency, per-step host overhead) and cached under
``data.cache_dir``.

Peaks are data-sheet figures; ``efficiency`` holds the fraction of each peak that training-sized
work reaches (matmuls, attention, memory-bound elementwise work, collective bus bandwidth). They are
inputs of the step-time model, stated in the file. ``h100-gt``'s are fitted to torchtitan's published
8B rows (``bench/published.py --fit``; its 70B and 405B rows stay predictions), and ``h100``'s and
``h200``'s attention terms to their own GPU's attention timings (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from shardwise.config.types import ConfigError, read_toml

PROFILE_DIR = Path(__file__).with_name("hardware")
RESERVED_OVER_LIVE = 1.13
"""What a GPU's caching allocator reserves at its high-water mark, per byte of the live-tensor peak
the memory model computes: its rounding, its per-stream pools and the fragmentation of a training
step's mix of lifetimes. Fitted (least squared log error, ``python bench/published.py --fit``) to
torchtitan's five published Llama 3.1 8B rows -- their ``max_reserved`` over shardwise's live
estimate of the same run, 1.06 to 1.20 -- and held by the 70B and 405B rows, which are not in the
fit (docs/planning.md). Local ranks (CPU) have no caching allocator: 1 there."""
GRID_ROWS = 2048
"""Rows of the GEMMs ``shardwise calibrate`` measures its grid of widths on (fewer for the widest,
whose calls it keeps near 0.1 s)."""
LOCAL_FILE = "hardware_local.toml"


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    memory_gib: float
    """Device memory capacity."""
    memory_bw_gbs: float
    """Device memory bandwidth, GB/s."""
    gpus_per_node: int
    intra_node_bw_gbs: float
    """Per-device collective bandwidth inside a node (one direction), GB/s."""
    intra_node_latency_us: float
    inter_node_bw_gbs: float
    """Per-device network bandwidth between nodes (one direction), GB/s."""
    inter_node_latency_us: float
    comm_overlap: bool
    """Whether collectives run concurrently with compute (GPU streams: yes; CPU gloo: no)."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)
    """Fraction of each peak training-sized work reaches: ``matmul`` (or ``matmul_<dtype>`` for one
    dtype, e.g. ``matmul_fp8``; with ``sms``, what a GEMM's full tiles reach, before its shape's
    losses), ``attention``, ``memory``, ``comm``."""
    host_us_per_op: float = 0.0
    """GPUs: host time per ATen op a block dispatches (Python, dispatcher, autograd, the kernel
    launch); a block waits for its host where that exceeds its kernels' time. 0: never."""
    attention_seq_half: float = 0.0
    """GPUs: the sequence length (query positions per call) at which causal flash attention runs at
    half its long-sequence rate (:func:`attention_efficiency`); 0: the same rate at every length."""
    attention_head_dim: dict[str, float] = field(default_factory=dict)
    """GPUs: attention's long-sequence rate per head width (``"64"``), relative to
    ``efficiency.attention`` (the rate at head width 128); interpolated between the widths
    measured, the nearest measured one outside them. Empty: the same rate at every width."""
    sms: int = 0
    """GPUs: streaming multiprocessors (AMD: compute units) that run a GEMM's output tiles in waves
    (:func:`gemm_seconds`); 0 costs every GEMM at the flat efficiency, whatever its shape."""
    # local (measured) only:
    cores: int = 0
    """CPU cores shared by the local ranks (0 on GPUs: one device per rank)."""
    thread_tflops: dict[str, float] = field(default_factory=dict)
    """Measured TFLOP/s: ``"fp32@2:256x1024"`` (a linear layer's forward + backward, dtype @ threads
    : in x out width), ``"attention_fp32@2:64:512"`` (causal attention, dtype @ threads : head dim
    : positions; older profiles: no positions) and ``"ring_attention_fp32@2:64:512"`` (a ring's
    unmasked step off its diagonal: 512 queries against 256 keys)."""
    memory_bw_per_thread_gbs: dict[str, float] = field(default_factory=dict)
    """Measured elementwise memory bandwidth per thread count (``"2"``), and for outputs larger
    than ``large_tensor_bytes``: with glibc's defaults (``"large@2"``) and with freed memory kept
    (``"cached@2"``, as training runs by default)."""
    large_tensor_bytes: int = 16 * 2**20
    """Above this, glibc's default malloc hands a step's outputs fresh pages (it maps large blocks
    with mmap and returns them on free; its adaptive threshold sat below this in the steps
    measured, see docs/planning.md). Runs with run.cpu_memory_cache (the default) do not."""
    overhead_ms: dict[str, float] = field(default_factory=dict)
    """Measured host time: ``per_block`` (one block's forward + backward + its optimizer share) and
    ``per_step``."""
    collective_bw_gbs: dict[str, float] = field(default_factory=dict)
    """Measured gloo bus bandwidth per number of processes (``"4"`` -> GB/s), and of groups of two
    all moving data at once among that many processes (``"2@4"``)."""
    collective_kind_bw_gbs: dict[str, float] = field(default_factory=dict)
    """Measured gloo bus bandwidth per collective, number of processes and buffer bytes per call
    (``"reduce_scatter@4:16777216"`` -> GB/s): gloo's kinds differ by 2-6x at one size (its
    reduce-scatter is the slowest) and each varies with the buffer's size."""
    shared_compute: dict[str, float] = field(default_factory=dict)
    """Measured per number of processes (``"4"``): the GEMM rate of each process while all of them
    run it, as a fraction of one process's rate at its fair share of the cores (caches, memory
    bandwidth and scheduling are shared too)."""

    collective_sync_us: dict[str, float] = field(default_factory=dict)
    """Measured per number of processes (``"4"``): what each collective call costs beyond its
    latency and bytes when it sits between compute, as in a training step -- the wait for the
    slowest process to reach it (with more processes than cores, for the OS to schedule it)."""

    def reserved(self, live: float) -> float:
        """Bytes the device's allocator reserves at a live-tensor peak of ``live`` bytes
        (``RESERVED_OVER_LIVE`` on GPUs; the live bytes on local CPU ranks)."""
        return live if self.cores else live * RESERVED_OVER_LIVE

    def sync_seconds(self, ranks: int) -> float:
        """Per collective call among ``ranks`` local processes (nearest measured count; 0 on GPUs)."""
        return 1e-6 * _nearest(self.collective_sync_us, ranks, 0.0) if ranks > 1 else 0.0

    def _threads(self, ranks: int) -> tuple[int, float]:
        """(threads each local rank runs, its share of a core: less than one when ranks outnumber
        cores, and less again by what sharing the machine was measured to cost)."""
        n = max(1, ranks)
        return max(1, self.cores // n), min(1.0, self.cores / n) * self.sharing(n)

    def sharing(self, ranks: int) -> float:
        """Measured compute efficiency of ``ranks`` local processes at once (nearest measured count;
        1 on GPUs and for one process)."""
        return _nearest(self.shared_compute, ranks, 1.0) if ranks > 1 else 1.0

    def _measured(self, prefix: str, ranks: int, size: int) -> float:
        threads, share = self._threads(ranks)
        table = {int(k.rsplit(":", 1)[1]): v for k, v in self.thread_tflops.items()
                 if k.startswith(f"{prefix}@{threads}:") and k.count(":") == 1}
        if not table:
            raise ConfigError(f"hardware '{self.name}' has no measured '{prefix}' rate for {threads} "
                              "thread(s): run `shardwise calibrate` again")
        return share * _interpolate(table, size)

    def matmul_tflops(self, dtype: str, k: int, n: int | None = None, ranks: int = 1, rows: int = 0) -> float:
        """Sustained TFLOP/s of one rank's linear layer with ``k`` inputs and ``n`` outputs
        (forward and backward) on ``rows`` rows per call (0: as many as the grid was measured on).
        On ``local``: interpolated from the measured grid of widths, times the measured slowdown of
        that few rows (:meth:`row_factor`)."""
        n = k if n is None else n
        if not self.cores:
            rate = self._peak(dtype) * self.efficiency.get(f"matmul_{dtype}", self.efficiency["matmul"])
            if not (self.sms and rows):
                return rate
            bw = self.memory_bw()
            # forward (rows x k) @ (k x n), input gradient (rows x n) @ (n x k), weight gradient
            # (k x rows) @ (rows x n): three shapes, each with its own tiles and waves
            seconds = sum(gemm_seconds(m_, k_, n_, rate, bw, self.sms, BYTES_PER[dtype])
                          for m_, k_, n_ in ((rows, k, n), (rows, n, k), (k, rows, n)))
            return 3 * 2 * rows * k * n / seconds / 1e12
        threads, share = self._threads(ranks)
        return share * self._grid_tflops(dtype, k, n, threads) * self.row_factor(dtype, k, n, ranks, rows)

    def row_factor(self, dtype: str, k: int, n: int, ranks: int, rows: int) -> float:
        """How much slower a ``k`` x ``n`` GEMM runs on ``rows`` rows than on the grid's (about
        2048): measured per square width (``"rows_bf16@1:256:128"``, TFLOP/s at width 256 on 128
        rows) against that width's grid rate, capped at 1, read at the geometric-mean width
        ``sqrt(k n)`` (the work per row decides it) -- an expert's GEMM on 128 rows of width 256
        runs at about two thirds of the grid's rate on one CPU thread. 1 on GPUs, for ``rows`` 0
        or at least 2048, and on profiles measured before rows were."""
        if not self.cores or not rows or rows >= GRID_ROWS:
            return 1.0
        by_width = self._row_fractions.get((dtype, self._threads(ranks)[0]))
        if not by_width:
            return 1.0
        return _interpolate({w: _interpolate(table, rows) for w, table in by_width.items()}, math.sqrt(k * n))

    @functools.cached_property
    def _row_fractions(self) -> dict[tuple[str, int], dict[int, dict[int, float]]]:
        """(dtype, threads) -> square width -> rows -> the measured fraction of the grid's rate
        (capped at 1; 1 at ``GRID_ROWS``), parsed once: ``plan`` costs every GEMM of every layout."""
        out: dict[tuple[str, int], dict[int, dict[int, float]]] = {}
        for key, v in self.thread_tflops.items():
            if key.startswith("rows_"):
                dtype, _, rest = key[len("rows_"):].partition("@")
                threads, w, r = (int(x) for x in rest.split(":"))
                out.setdefault((dtype, threads), {}).setdefault(w, {GRID_ROWS: 1.0})[r] = v
        for (dtype, threads), by_width in out.items():
            for w, table in by_width.items():
                grid = self._grid_tflops(dtype, w, w, threads)
                by_width[w] = {r: min(1.0, v / grid) if r != GRID_ROWS else v for r, v in table.items()}
        return out

    def _grid_tflops(self, dtype: str, k: int, n: int, threads: int) -> float:
        """TFLOP/s measured on ``threads`` threads, interpolated from the grid of widths."""
        grid = {}
        for key, v in self.thread_tflops.items():
            if key.startswith(f"{dtype}@{threads}:"):
                a, _, b = key.rsplit(":", 1)[1].partition("x")
                grid[(int(a), int(b))] = v
        if not grid:
            raise ConfigError(f"hardware '{self.name}' has no measured {dtype} GEMM rate for {threads} "
                              "thread(s): run `shardwise calibrate` again")
        ks = sorted({a for a, _ in grid})
        if len(grid) == len(ks):  # square weights only: by the smaller width
            return _interpolate({a: grid[(a, b)] for a, b in grid}, min(k, n))
        by_in = {a: _interpolate({b: grid[(a, b)] for aa, b in grid if aa == a}, n) for a in ks}
        return _interpolate(by_in, k)

    def attention_tflops(self, dtype: str, head_dim: int, ranks: int = 1, seq: int = 0,
                         causal: bool = True) -> float:
        """Sustained TFLOP/s of one rank's causal attention (forward + backward) over ``seq`` query
        positions per call. On ``local``: interpolated from the measured grid of head widths and
        sequence lengths (profiles from before the sequence was measured: by head width). Not
        ``causal``: a context-parallel ring's unmasked steps (``seq`` queries, ``seq / 2`` keys) at
        their own measured rates (``ring_attention_*``); GPUs, and profiles from before those were
        measured, cost them at the causal rate."""
        if not self.cores:
            return self._peak(dtype) * attention_efficiency(self, head_dim, seq)
        threads, share = self._threads(ranks)
        for kind in ("attention",) if causal else ("ring_attention", "attention"):
            prefix = f"{kind}_{dtype}@{threads}:"
            grid = {tuple(int(x) for x in k[len(prefix):].split(":")): v
                    for k, v in self.thread_tflops.items() if k.startswith(prefix) and k.count(":") == 2}
            if grid:
                break
        if not grid:
            return self._measured(f"attention_{dtype}", ranks, head_dim)
        seq = seq or 512
        dims = sorted({d for d, _ in grid})
        rows = {d: _interpolate({s: v for (dd, s), v in grid.items() if dd == d}, seq) for d in dims}
        return share * _interpolate(rows, head_dim)

    def memory_bw(self, ranks: int = 1, tensor_bytes: float = 0, cached: bool = True,
                  elementwise: bool = True) -> float:
        """Bytes/s one rank's elementwise (memory-bound) work moves on tensors of ``tensor_bytes``.
        On ``local``, outputs above ``large_tensor_bytes`` are costed by how the rank's C library
        serves them: with ``cached`` (run.cpu_memory_cache, the default: glibc keeps freed memory)
        from the heap's resident pages, at the rate measured so (``cached@T``; profiles from before
        it: the small-tensor rate); without, from fresh pages the OS faults in on first touch (glibc
        maps large blocks and unmaps them on free), at the ``large@T`` rate. Not ``elementwise``
        (FSDP's copies into and out of its flat buffers: a few large copies and casts per block), on
        ``local``: at the microbenchmark's rate, without the fraction of it a step's many small eager
        ops reach (``efficiency.memory``, measured by ``calibrate``'s probe step)."""
        if self.cores:
            threads, share = self._threads(ranks)
            rates = self.memory_bw_per_thread_gbs
            large = tensor_bytes > self.large_tensor_bytes and rates.get(
                f"{'cached' if cached else 'large'}@{threads}")
            efficiency = self.efficiency.get("memory", 1.0) if elementwise else 1.0
            return (large or rates[str(threads)]) * 1e9 * share * efficiency
        return self.memory_bw_gbs * 1e9 * self.efficiency["memory"]

    def _peak(self, dtype: str) -> float:
        peak = self.peak_tflops.get(dtype, 0.0)
        if peak <= 0:
            raise ConfigError(f"hardware '{self.name}' has no {dtype} peak (float8 on A100?): choose "
                              "other hardware or turn the feature off")
        return peak

    def link(self, span_ranks: int, members: int = 0, world: int = 0, kind: str = "",
             nbytes: int = 0) -> tuple[float, float]:
        """(bus bandwidth bytes/s, per-hop latency s) for a group whose members span
        ``span_ranks`` consecutive ranks: inside one node, or across nodes (each device's NIC). On
        ``local``, by the group's size (``members``) and how many processes the job runs
        (``world``): pairs inside a bigger job at the rate measured with every pair busy; whole
        groups at the rate measured for the collective ``kind`` and a buffer of ``nbytes`` per call
        (interpolated by size), where the profile has it."""
        if self.collective_bw_gbs:  # local: measured per number of processes
            n = members or span_ranks
            pairs = {k[2:]: v for k, v in self.collective_bw_gbs.items() if k.startswith("2@")}
            if n == 2 and world > 2 and pairs:
                return _nearest(pairs, world, 0.0) * 1e9, self.intra_node_latency_us * 1e-6
            kinds = {k[len(kind) + 1:]: v for k, v in self.collective_kind_bw_gbs.items()
                     if kind and k.startswith(f"{kind}@")}
            if kinds:  # "world:bytes" -> GB/s: the nearest measured world, then by size
                w = min({k.partition(":")[0] for k in kinds}, key=lambda x: abs(int(x) - n))
                by_size = {int(b): v for k, v in kinds.items() for ww, _, b in [k.partition(":")] if ww == w}
                return _interpolate(by_size, nbytes or max(by_size)) * 1e9, self.intra_node_latency_us * 1e-6
            sizes = {k: v for k, v in self.collective_bw_gbs.items() if "@" not in k}
            return _nearest(sizes, n, 0.0) * 1e9, self.intra_node_latency_us * 1e-6
        eff = self.efficiency.get("comm", 1.0)
        if span_ranks <= self.gpus_per_node:
            return self.intra_node_bw_gbs * 1e9 * eff, self.intra_node_latency_us * 1e-6
        return self.inter_node_bw_gbs * 1e9 * eff, self.inter_node_latency_us * 1e-6


GEMM_TILE = (128, 256)
"""Output tile (rows x columns) one GPU multiprocessor computes at a time in the GEMM model: the
largest tile of CUTLASS's Hopper bf16/fp8 kernels, which cuBLAS picks for training-sized
products. Smaller shapes lose to partial tiles and to a last wave that leaves multiprocessors idle
(NVIDIA's "Matrix Multiplication Background" guide: tile and wave quantization)."""
SPLIT_K_MAX = 16
"""Most pieces the model splits a GEMM's reduction into when its output tiles leave
multiprocessors idle (cuBLAS's split-K / stream-K kernels), each piece at least 256 deep."""
BYTES_PER = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


@functools.lru_cache(maxsize=1 << 16)
def gemm_seconds(m: int, k: int, n: int, tflops: float, bw: float, sms: int, elt: int) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM on a GPU of ``sms`` multiprocessors whose full tiles
    run at ``tflops`` in all, with ``bw`` bytes/s of memory bandwidth for its operands (``elt``
    bytes per element). The output is cut into ``GEMM_TILE`` tiles, run in waves of ``sms`` tiles:
    a partial tile costs a whole one and a wave a whole wave. When the tiles leave multiprocessors
    idle, the reduction is split into up to ``SPLIT_K_MAX`` pieces (each an fp32 partial output,
    written and read back); the split with the least time is taken. The time is the larger of that
    compute time and the operands' memory traffic (roofline)."""
    tm, tn = GEMM_TILE
    tiles = -(-m // tm) * -(-n // tn)
    per_sm = tflops * 1e12 / sms
    best = math.inf
    for split in range(1, max(1, min(SPLIT_K_MAX, k // 256)) + 1):
        waves = -(-tiles * split // sms)
        compute = waves * 2 * tm * tn * -(-k // split) / per_sm
        traffic = elt * (m * k + k * n + m * n) + (8 * split * m * n if split > 1 else 0)
        best = min(best, max(compute, traffic / bw))
    return best


def attention_efficiency(hw: Hardware, head_dim: int, seq: int) -> float:
    """The fraction of a GPU's peak that causal flash attention (forward + backward, FLOPs as the
    planner counts them) reaches on heads of ``head_dim`` over ``seq`` query positions per call.

    Besides its matmuls, a flash kernel spends time per query row that does not shrink with the
    sequence (loading and writing the row's tiles, the backward's row sums, the masked half of
    the diagonal tile), so its rate is ``s / (s + attention_seq_half)`` of the long-sequence rate;
    that rate depends on the head width through the kernel's tile shapes (on Hopper, 64, 96 and 256
    run 14-21% below 128), a measured table. Both fitted per GPU on causal SDPA timings
    (``bench/gpu_model.py --only-attention``; docs/planning.md)."""
    eff = hw.efficiency["attention"]
    if hw.attention_head_dim:
        eff *= _interpolate({int(k): v for k, v in hw.attention_head_dim.items()}, head_dim)
    if hw.attention_seq_half:
        if seq <= 0:
            raise ValueError(f"attention_efficiency needs the sequence length on '{hw.name}', got {seq}")
        eff *= seq / (seq + hw.attention_seq_half)
    return eff


def _nearest(table: dict[str, float], n: int, default: float) -> float:
    """The value measured for the process count (key) nearest ``n``; ``default`` if none was."""
    if not table:
        return default
    return table[min(table, key=lambda k: abs(int(k) - n))]


def _interpolate(table: dict[int, float], x: float) -> float:
    """Log-linear interpolation of measured rates by size, clamped at the measured ends."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    if x >= xs[-1]:
        return table[xs[-1]]
    for lo, hi in zip(xs, xs[1:], strict=False):
        if lo <= x <= hi:
            f = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return table[lo] + f * (table[hi] - table[lo])
    return table[xs[-1]]


def available() -> list[str]:
    """Names of the shipped profiles, plus ``local``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml")) + ["local"]


def local_path(cache_dir: str = "~/.cache/shardwise") -> Path:
    return Path(cache_dir).expanduser() / LOCAL_FILE


def load_hardware(name: str, cache_dir: str = "~/.cache/shardwise") -> Hardware:
    """A shipped profile by name, ``local`` (from ``shardwise calibrate``), or a TOML file path."""
    if name == "local":
        path = local_path(cache_dir)
        if not path.is_file():
            raise ConfigError(f"no calibration of this machine at {path}: run `shardwise calibrate` first "
                              "(about two minutes)")
    elif name.endswith(".toml"):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"hardware file '{name}' does not exist")
    else:
        path = PROFILE_DIR / f"{name}.toml"
        if not path.is_file():
            raise ConfigError(f"unknown hardware '{name}'; choose one of {', '.join(available())} or "
                              "pass a .toml profile")
    data = read_toml(path, "hardware profile")
    known = {f.name for f in dataclasses.fields(Hardware)}
    if unknown := set(data) - known:
        raise ConfigError(f"hardware profile {path}: unknown key(s) {', '.join(sorted(unknown))}")
    try:
        return Hardware(**data)
    except TypeError as e:
        raise ConfigError(f"hardware profile {path}: {e}") from None


def profile_device(name: str) -> str:
    """The device type a profile plans for: "cpu" for a measured machine (``local``, or a profile
    file with ``cores``), else "cuda" -- what ``auto`` settings (precision, run.device) resolve to."""
    if name == "local":
        return "cpu"
    if name.endswith(".toml") and Path(name).is_file():
        return "cpu" if load_hardware(name).cores else "cuda"
    return "cuda"


def save_hardware(hw: Hardware, path: Path) -> None:
    """Write a profile atomically (a temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data: dict[str, Any] = {k: v for k, v in dataclasses.asdict(hw).items() if v not in ({}, None)}
    tmp.write_text(tomli_w.dumps(data))
    os.replace(tmp, path)
