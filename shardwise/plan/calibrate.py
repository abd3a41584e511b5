"""``shardwise calibrate``: measure this machine into the ``local`` hardware profile.

What the step-time model needs, each measured the way training uses it:

- **GEMM throughput** per dtype (bf16, fp32) and thread count: a linear layer's forward and
  backward for in/out widths 128 to 2048 (small widths run far below the large-GEMM
  peak on CPUs), bf16 as a bf16 run computes them (on CPUs without bf16 arithmetic, as fp32 GEMMs:
  :mod:`shardwise.ops.cpu_bf16`);
- **attention throughput** (causal SDPA, forward + backward, FLOPs as ``executed_flops`` counts
  them) per dtype, thread count, head width and sequence length; and the same for the unmasked
  calls a context-parallel ring makes off its diagonal;
- **memory bandwidth** of eager elementwise ops writing new outputs (what norms, RoPE, SwiGLU,
  casts, FSDP's copies and the optimizer are bound by), per thread count, for outputs below and
  above the allocator's mmap threshold (fresh pages are faulted in: several times slower);
- **gloo collectives** among 2, 4 and 8 local processes: bus bandwidth of all-gather /
  reduce-scatter / all-reduce on MiB-sized buffers and the latency of a tiny all-reduce;
- **host overhead**: the Python/dispatcher time of a training step per transformer block and per
  step, from a model too small for its kernels to matter, through FSDP as the trainer runs it;
  and what tensor parallel (DTensor dispatch, redistributions) adds per block, on 2 processes.

Thread counts are those the trainer gives N local ranks (``cores // N``, at least 1). The result is
written to ``<data.cache_dir>/hardware_local.toml`` and read as ``--hardware local``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shardwise.launch.process import enter_rank, start_rank_server
from shardwise.ops.cpu_bf16 import bf16_gemms_as_runs_make_them
from shardwise.plan.hardware import GRID_ROWS, Hardware, local_path, save_hardware
from shardwise.plan.probes import (
    DTYPES,
    attention_keys,
    attention_step,
    host_overhead_ms,
    linear_step,
    median_seconds,
    memory_efficiency,
    tiny_step,
)
from shardwise.runtime.machine import cpu_has_native_bf16, keep_freed_cpu_memory, usable_cores

GEMM_SIZES = (128, 256, 512, 1024, 2048)
HEAD_DIMS = (16, 32, 64, 128)
ATTENTION_SEQS = (128, 256, 512, 1024)
ROW_WIDTHS = (128, 256, 512, 1024)
"""Square widths whose GEMM rate is also measured on few rows (``ROW_COUNTS``): a routed expert's
share of the tokens, a small micro-batch."""
ROW_COUNTS = (64, 128, 256, 512, 1024)
WORLDS = (2, 4, 8)


def gemm_tflops(dtype: torch.dtype, k: int, n: int, seconds: float = 0.2, rows: int = 0) -> float:
    """A linear layer's forward and backward (:func:`~shardwise.plan.probes.linear_step`) with ``k``
    inputs and ``n`` outputs, 6 * T * k * n FLOPs, on ``rows`` rows T -- or (0) on T sized from a
    first small call so that one call takes about 0.1 s, at most ``GRID_ROWS``. (A grouped expert
    GEMM runs at the rate of one of these on its rows.)"""
    def rate(tokens: int, secs: float) -> float:
        return 6 * tokens * k * n / median_seconds(linear_step(dtype, k, n, tokens), secs) / 1e12
    if rows:
        return rate(rows, seconds)
    probe = rate(64, 0.0)
    tokens = int(min(GRID_ROWS, max(64, 0.1 * probe * 1e12 / (6 * k * n))))
    return rate(tokens, seconds)


def attention_tflops(dtype: torch.dtype, head_dim: int, seconds: float = 0.2, seq: int = 512,
                     causal: bool = True) -> float:
    """Causal SDPA forward + backward over ``seq`` positions; FLOPs counted like ``executed_flops``:
    4 * H * D per (query, key) pair forward, 2.5x that backward, S(S+1)/2 pairs. (On CPUs the rate
    depends on the sequence length and hardly on batch or heads.) Not ``causal``: a ring
    attention's step off the diagonal, ``seq`` queries against ``seq // 2`` keys unmasked
    (S * S / 2 pairs), which runs faster a FLOP than the causal call of the same queries
    (bench/results/history.md)."""
    b, s, heads = 2, seq, max(1, 256 // head_dim)
    pairs = s * (s + 1) / 2 if causal else s * attention_keys(s, causal)
    flops = 4 * heads * head_dim * b * pairs * 3.5
    return flops / median_seconds(attention_step(dtype, b, heads, s, head_dim, causal), seconds) / 1e12


def memory_gbs(large: bool = False, seconds: float = 0.3) -> float:
    """Bytes per second an eager elementwise op moves: out-of-place adds (two reads, one write into
    a new tensor, as every op of a training step allocates its output). Small: 8 MiB tensors
    cycling through a 400 MiB working set (out of cache, outputs reused from the allocator's
    heap); ``large``: 64 and 128 MiB ones, whose outputs are fresh memory the OS page-faults in on
    first touch, which on CPUs costs far more than the copy itself."""
    sizes = [2**24, 2**25] if large else [2**21] * 25  # fp32 elements
    pairs = [(torch.randn(n), torch.randn(n)) for n in sizes]

    def step() -> None:
        for a, b in pairs:
            torch.add(a, b)
    return 3 * 4 * sum(sizes) / median_seconds(step, seconds) / 1e9


def _cached_memory_gbs(threads: tuple[int, ...], seconds: float) -> dict[str, float]:
    """The ``large`` elementwise rate per thread count with glibc keeping freed memory, as training
    ranks run (run.cpu_memory_cache): measured in a process of its own, since that setting cannot be
    undone in this one."""
    keep_freed_cpu_memory()
    rates = {}
    for th in threads:
        torch.set_num_threads(th)
        memory_gbs(large=True, seconds=seconds)  # (the heap grows to the working set first)
        rates[f"cached@{th}"] = memory_gbs(large=True, seconds=seconds)
    return rates


def _timed_collective(fn: Callable[[], object], runs: int = 5) -> float:
    """Median of a fixed number of calls (all ranks must make the same calls: not until a time is up)."""
    fn()
    return statistics.median(_collective_samples(fn, runs))


def _collective_samples(fn: Callable[[], object], runs: int) -> list[float]:
    """Seconds of ``runs`` calls of ``fn``, each started together after a barrier."""
    import torch.distributed as dist

    times = []
    for _ in range(runs):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def gather_scatter() -> tuple[Callable, Callable]:
    """All-gather and reduce-scatter into one tensor: torch 2.13 renames them (the old names warn);
    2.11 has only the old ones."""
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor))


def _kind_rates(world: int, sizes_mib: list[int]) -> dict[str, float]:
    """Bus bandwidth (GB/s) of each collective kind on buffers of ``sizes_mib`` MiB (fp32) among
    this job's ``world`` processes. Gloo's kinds differ (its reduce-scatter is the slowest) and
    each varies with the buffer's size, so FSDP's per-block buffers and tensor parallel's
    activations each get their own. Each (kind, size) is the median of its calls over
    ``KIND_ROUNDS`` rounds through all of them: a slow spell of a shared machine lands in one round
    rather than on one size, where it would bend the fit of bandwidth against buffer size."""
    import torch.distributed as dist

    gather, scatter = gather_scatter()
    buffers = {mib: (torch.randn(mib * 2**18), torch.randn(mib * 2**18 // world)) for mib in sizes_mib}
    calls = {"all_gather": lambda full, part: gather(full, part),
             "reduce_scatter": lambda full, part: scatter(part, full),
             "all_reduce": lambda full, part: dist.all_reduce(full)}
    fns = {(kind, mib): functools.partial(call, *buffers[mib]) for mib in sizes_mib
           for kind, call in calls.items()}
    for fn in fns.values():  # (a first call sets up gloo's buffers)
        fn()
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in fns}
    for _ in range(KIND_ROUNDS):
        for key, fn in fns.items():
            samples[key] += _collective_samples(fn, 3)
    rates = {}
    for (kind, mib), times in samples.items():
        gb = (world - 1) / world * mib * 2**20 / 1e9  # each rank sends this much in a ring, GB
        factor = 2 if kind == "all_reduce" else 1  # (an all-reduce sends twice that)
        rates[f"{kind}@{world}:{mib * 2**20}"] = factor * gb / statistics.median(times)
    return rates


SYNC_PAIRS = 9  # paired runs of compute with and without a collective per iteration: the wait
LATENCY_CALLS = 50  # tiny all-reduces per timing of the per-hop latency
KIND_ROUNDS = 3  # rounds through every collective kind and buffer size, 3 calls each per round
SHARE_ROUNDS = 5  # barrier-to-barrier rounds of the same work on every process: the share of the cores


def _share_work(a: torch.Tensor, b: torch.Tensor, calls: int = 40) -> None:
    """The fixed work of the share-of-the-cores measurement: ``calls`` GEMMs of (256 x 1024) @ (1024
    x 1024), as in the wait-per-collective measurement (about 0.3 s on one thread of a 2-core VM)."""
    for _ in range(calls):
        torch.mm(a, b)


def _collective_worker(rank: int, world: int, init: str, out: str, sizes_mib: tuple[int, ...],
                       quick: bool) -> None:
    import json

    import torch.distributed as dist

    enter_rank({})  # (forked from the rank server, as training's ranks are)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    size = 4 * 2**20  # fp32 elements: 16 MiB gathered / reduced
    x = torch.randn(size)
    timed = _timed_collective
    gather, scatter = gather_scatter()
    tiny = torch.zeros(2)
    # (per call, over back-to-back calls: one call after a barrier also times the processes'
    # wake-up skew, which put 2 processes' hop at 80 us in one calibration and 1,650 in the next)
    t_lat = timed(lambda: [dist.all_reduce(tiny) for _ in range(LATENCY_CALLS)], runs=7) / LATENCY_CALLS
    results: dict = {"latency_s": t_lat / (2 * (world - 1)), "kinds": {}}
    # (16 MiB always: the figure a kind-less lookup uses)
    results["kinds"].update(_kind_rates(world, sorted({16, *sizes_mib})))
    if world >= 4:
        # Groups of two inside a busier machine, as tensor or context parallel pairs run in a
        # 4- or 8-rank job: every pair moves its buffer at once.
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        pair, pshard = pairs[rank // 2], torch.randn(size // 2)
        t_pair = statistics.median([timed(lambda: gather(x, pshard, group=pair)),
                                    timed(lambda: scatter(pshard, x, group=pair)),
                                    timed(lambda: dist.all_reduce(x, group=pair)) / 2])
        results["pair"] = x.numel() * 4 / 2 / t_pair
    # What a collective costs between compute when every process computes: each rank reaches it
    # when the OS has given it its share of the cores, so all wait for the slowest (with more
    # processes than cores, a scheduling quantum per call). Compute-only vs compute + a tiny
    # all-reduce per iteration, every process at once.
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)

    def work(sync: bool) -> None:
        for _ in range(40):
            torch.mm(a, b)
            if sync:
                dist.all_reduce(tiny)
    def once(sync: bool) -> float:
        return _collective_samples(lambda: work(sync), 1)[0]
    # The wait is a small difference of two long timings: back-to-back pairs, so that the machine's
    # drift cancels, and their median (two medians of separate runs differed by 20x across
    # calibrations an hour apart).
    work(False), work(True)
    diffs = [once(True) - once(False) for _ in range(SYNC_PAIRS // 2 + 1 if quick else SYNC_PAIRS)]
    results["sync_s"] = max(0.0, statistics.median(diffs) / 40 - t_lat)
    # What sharing the cores does to compute, as a step meets it: the same fixed work on every process
    # from one barrier to the next (each process timing its own calls let one that ran while others
    # waited count the cores as its own: 0.79, 1.00, 0.49 of a fair share for 2, 4, 8 in one calibration).
    _share_work(a, b)
    rounds = _collective_samples(lambda: (_share_work(a, b), dist.barrier()), SHARE_ROUNDS)
    makespan = torch.tensor([statistics.median(rounds)], dtype=torch.float64)
    dist.all_reduce(makespan, op=dist.ReduceOp.MAX)
    results["share_makespan_s"] = makespan.item()
    if world == 2:
        results["tp_block_s"] = _tp_block_seconds(8 if quick else 15)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _tp_block_seconds(rounds: int = 15) -> float:
    """Host time tensor parallel adds per block (DTensor dispatch, redistributions, its collectives'
    waits) over the same blocks under FSDP, on the current 2-process group: tiny models of 1 and 5
    blocks, so kernels play no part. Each round times the four steps back to back and yields one
    difference of differences; the median of the rounds (medians of separate runs, differenced,
    gave 12 and 25 ms in two calibrations an hour apart)."""
    steps = [tiny_step(n, layout) for layout in (("--parallel.dp_shard=2",), ("--parallel.tp=2",))
             for n in (1, 5)]  # fsdp 1, fsdp 5, tp 1, tp 5
    for step in steps:  # (first calls build caches)
        step()
    diffs = []
    for _ in range(rounds):
        f1, f5, t1, t5 = (_collective_samples(step, 1)[0] for step in steps)
        diffs.append(((t5 - t1) - (f5 - f1)) / 4)
    return max(0.0, statistics.median(diffs))


def collective_bandwidth(world: int, mib: tuple[int, ...] = (1, 4, 16, 64), quick: bool = False) -> dict:
    """Gloo among ``world`` local processes forked from the rank server: bus bandwidth (GB/s), per-hop
    latency (s), each kind's bus bandwidth per buffer size (``"reduce_scatter@4:16777216"`` -> GB/s),
    and with 2 processes tensor parallel's host time per block (s). ``quick``: fewer rounds."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.json")
        start_rank_server(world, 0)
        args = (world, f"file://{Path(d) / 'pg'}", out, mib, quick)
        mp.start_processes(_collective_worker, args=args, nprocs=world, start_method="forkserver")
        r = json.loads(Path(out).read_text())
    r["bw_gbs"] = statistics.median(r["kinds"][f"{k}@{world}:{16 * 2**20}"]
                                    for k in ("all_gather", "reduce_scatter", "all_reduce"))
    if "pair" in r:
        r["pair_gbs"] = r["pair"] / 1e9
    return r


def _thread_rates(threads: list[int], gemm_sizes: tuple[int, ...], seqs: tuple[int, ...],
                  rows: tuple[tuple[int, ...], tuple[int, ...]], secs: float,
                  log: Callable[[str], None], slim_bf16: bool = False) -> tuple[dict, dict[str, float]]:
    """(TFLOP/s of GEMMs, GEMMs on few rows and attention; elementwise GB/s) per thread count
    (``slim_bf16``: bf16 GEMMs at the second-largest width, attention at the longest sequence)."""
    row_widths, row_counts = rows
    rates: dict[str, float] = {}
    bandwidth: dict[str, float] = {}
    for th in threads:
        torch.set_num_threads(th)
        for name, dtype in DTYPES.items():
            # fp32: every (in, out) pair of widths; bf16 square only (and with ``slim``, one width)
            slim = slim_bf16 and name == "bf16"
            pairs = itertools.product(gemm_sizes, repeat=2) if name == "fp32" else \
                ((w, w) for w in (gemm_sizes[-2:-1] if slim else gemm_sizes))
            with bf16_gemms_as_runs_make_them(name):
                for k, n in pairs:
                    rates[f"{name}@{th}:{k}x{n}"] = gemm_tflops(dtype, k, n, 0.2 * secs)
                for w, r in itertools.product(row_widths, row_counts):
                    rates[f"rows_{name}@{th}:{w}:{r}"] = gemm_tflops(dtype, w, w, 0.1 * secs, rows=r)
            for hd, seq in itertools.product(HEAD_DIMS, seqs[-1:] if slim else seqs):
                rates[f"attention_{name}@{th}:{hd}:{seq}"] = attention_tflops(dtype, hd, 0.2 * secs, seq)
                rates[f"ring_attention_{name}@{th}:{hd}:{seq}"] = attention_tflops(dtype, hd, 0.2 * secs, seq,
                                                                                causal=False)
        bandwidth[str(th)] = memory_gbs(seconds=0.3 * secs)
        bandwidth[f"large@{th}"] = memory_gbs(large=True, seconds=0.3 * secs)
        w = gemm_sizes[-2]
        att = {d: rates[f"attention_{d}@{th}:64:{seqs[-1]}"] for d in DTYPES}
        log(f"  {th} thread(s): GEMM at width {w}: fp32 {rates[f'fp32@{th}:{w}x{w}']:.3f} TFLOP/s, bf16 "
            f"{rates[f'bf16@{th}:{w}x{w}']:.3f}; attention at head dim 64, {seqs[-1]} positions: fp32 "
            f"{att['fp32']:.3f}, bf16 {att['bf16']:.3f}; "
            f"memory {bandwidth[str(th)]:.1f} GB/s ({bandwidth[f'large@{th}']:.1f} for outputs over "
            "16 MiB)")
    start_rank_server(1, 0)  # (its imports start only now: they would slow the timings above)
    with multiprocessing.get_context("forkserver").Pool(1, enter_rank, ({},)) as pool:
        bandwidth.update(pool.apply(_cached_memory_gbs, (tuple(threads), 0.3 * secs)))
    log("  memory on outputs over 16 MiB with freed memory kept (training's default): "
        + ", ".join(f"{bandwidth[f'cached@{th}']:.1f} GB/s on {th} thread(s)" for th in threads))
    return rates, bandwidth


def calibrate(cache_dir: str = "~/.cache/shardwise", log: Callable[[str], None] = print,
              quick: bool = False) -> Hardware:
    """Measure this machine and save it as the ``local`` profile. ``quick``: fewer GEMM widths, shorter
    timings, fewer rounds, 2 and 4 processes only (about a fifth of the time; noisier), and without
    native bf16 (``auto`` trains in fp32) bf16 at one width and sequence (most of the time there)."""
    gemm_sizes, worlds = ((128, 512, 2048), (2, 4)) if quick else (GEMM_SIZES, WORLDS)
    seqs = (256, 512, 1024) if quick else ATTENTION_SEQS
    row_widths, row_counts = ((128, 512), (128, 512)) if quick else (ROW_WIDTHS, ROW_COUNTS)
    secs = 0.25 if quick else 1.0  # (of each measurement's default duration)
    cores = usable_cores()
    threads = sorted({1, cores})
    old_threads = torch.get_num_threads()
    try:
        rates, bandwidth = _thread_rates(threads, gemm_sizes, seqs, (row_widths, row_counts), secs, log,
                                         slim_bf16=quick and not cpu_has_native_bf16())
        torch.set_num_threads(1 if cores == 1 else cores)
        per_block, per_step, per_moe_block, probe, rest = host_overhead_ms(secs)
        log(f"  host overhead: {per_block:.2f} ms per block ({per_moe_block:.2f} per MoE block), "
            f"{per_step:.2f} ms per step")
    finally:
        torch.set_num_threads(old_threads)
    coll, kinds, latency, per_tp_block, shared, sync = {}, {}, [], 0.0, {}, {}
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    alone = median_seconds(lambda: _share_work(a, b), 0.0, min_runs=SHARE_ROUNDS)  # the workers' work, alone
    torch.set_num_threads(old_threads)
    for w in worlds:
        r = collective_bandwidth(w, (4, 16) if quick else (1, 4, 16, 64), quick)
        coll[str(w)] = r["bw_gbs"]
        kinds.update(r["kinds"])
        if "pair_gbs" in r:
            coll[f"2@{w}"] = r["pair_gbs"]
        latency.append(r["latency_s"])
        # the work's makespan at a fair share of the cores (one process alone, stretched by
        # processes over cores) over the measured one
        shared[str(w)] = min(1.0, alone * max(1.0, w / cores) / r["share_makespan_s"])
        sync[str(w)] = 1e6 * r["sync_s"]
        log(f"  gloo, {w} processes: {r['bw_gbs']:.2f} GB/s bus bandwidth, {1e6 * r['latency_s']:.0f} us per "
            "hop" + (f", pairs {r['pair_gbs']:.2f} GB/s at once" if "pair_gbs" in r else "")
            + (f"; tensor parallel adds {1e3 * r['tp_block_s']:.1f} ms host time per block"
               if "tp_block_s" in r else "")
            + f"; compute {shared[str(w)]:.2f} of a fair share of the cores, {sync[str(w)]:.0f} us waiting "
              "per collective between compute")
        if "tp_block_s" in r:
            per_tp_block = 1e3 * r["tp_block_s"]
    hw = Hardware(
        name="local", description=f"this machine: {cores} CPU cores, measured by shardwise calibrate"
                                   + (" --quick" if quick else ""),
        memory_gib=_ram_gib(), memory_bw_gbs=bandwidth[str(max(threads))], gpus_per_node=cores,
        intra_node_bw_gbs=max(coll.values()), intra_node_latency_us=1e6 * statistics.median(latency),
        inter_node_bw_gbs=max(coll.values()), inter_node_latency_us=1e6 * statistics.median(latency),
        comm_overlap=False, peak_tflops={}, efficiency={"memory": 1.0}, cores=cores,
        thread_tflops=rates, overhead_ms={"per_block": per_block, "per_step": per_step,
                                          "per_moe_block": per_moe_block, "per_tp_block": per_tp_block},
        collective_bw_gbs=coll, collective_kind_bw_gbs=kinds, memory_bw_per_thread_gbs=bandwidth,
        shared_compute=shared,
        collective_sync_us=sync)
    hw = dataclasses.replace(hw, efficiency={"memory": memory_efficiency(hw, rest)})
    log(f"  a real step of a dim-192 model: {1e3 * probe:.0f} ms, {1e3 * rest:.0f} beyond its GEMMs and "
        "attention (timed in pairs); its memory-bound work ran at "
        f"{hw.efficiency['memory']:.2f} of the elementwise microbenchmark's bandwidth")
    save_hardware(hw, local_path(cache_dir))
    return hw


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0
