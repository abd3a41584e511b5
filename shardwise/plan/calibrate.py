"""``shardwise calibrate``: measure this machine into the ``local`` hardware profile.

What the step-time model needs, each measured the way training uses it:

- **GEMM throughput** per dtype (bf16, fp32) and thread count, for ``tokens x K @ K x N`` products
  with ``K = N`` from 128 to 4096 (small widths run far below the large-GEMM peak on CPUs);
- **attention throughput** (causal SDPA, forward + backward, FLOPs as ``executed_flops`` counts
  them) per dtype, thread count and head width;
- **memory bandwidth** of an elementwise op (what norms, RoPE, SwiGLU, casts and the optimizer
  are bound by), per thread count;
- **gloo collectives** among 2, 4 and 8 local processes: bus bandwidth of all-gather /
  reduce-scatter / all-reduce on MiB-sized buffers and the latency of a tiny all-reduce;
- **host overhead**: the Python/dispatcher time of a training step per transformer block and per
  step, from a model too small for its kernels to matter, through FSDP as the trainer runs it.

Thread counts are those the trainer gives N local ranks (``cores // N``, at least 1). The result is
written to ``<data.cache_dir>/hardware_local.toml`` and read as ``--hardware local``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.plan.hardware import Hardware, local_path, save_hardware

GEMM_SIZES = (128, 256, 512, 1024, 2048, 4096)
HEAD_DIMS = (16, 32, 64, 128)
WORLDS = (2, 4, 8)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time(fn: Callable[[], object], seconds: float, min_runs: int = 3) -> float:
    """Median seconds per call of ``fn`` over about ``seconds`` (one warm-up call first)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_tflops(dtype: torch.dtype, width: int, tokens: int = 2048, seconds: float = 0.3) -> float:
    a = torch.randn(tokens, width).to(dtype)
    b = torch.randn(width, width).to(dtype)
    return 2 * tokens * width * width / _time(lambda: a @ b, seconds) / 1e12


def attention_tflops(dtype: torch.dtype, head_dim: int, seconds: float = 0.5) -> float:
    """Causal SDPA forward + backward; FLOPs counted like ``executed_flops``: 4 * H * D per
    (query, key) pair forward, 2.5x that backward, S(S+1)/2 pairs."""
    b, s = 2, 1024
    heads = max(1, 512 // head_dim)
    q, k, v = (torch.randn(b, heads, s, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, head_dim, dtype=dtype)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    flops = 4 * heads * head_dim * b * s * (s + 1) / 2 * 3.5
    return flops / _time(step, seconds) / 1e12


def memory_gbs(seconds: float = 0.3) -> float:
    """Bytes moved per second by an out-of-place add of 64 MiB fp32 tensors (two reads, a write)."""
    n = 16 * 2**20
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return 3 * 4 * n / _time(lambda: torch.add(a, b, out=c), seconds) / 1e9


def _tiny_step(layers: int) -> Callable[[], None]:
    """A training step (forward, backward, clipping, AdamW) of a dim-32 model with ``layers``
    blocks through the trainer's own FSDP and loss, on the current one-rank process group."""
    from shardwise.config import load_config
    from shardwise.data.dataset import Batch
    from shardwise.models import build_model, init_weights, model_args
    from shardwise.optim.adamw import build_optimizer
    from shardwise.optim.clip import clip_grad_norm_
    from shardwise.parallel.dims import ParallelDims
    from shardwise.parallel.parallelize import parallelize
    from shardwise.train import forward_backward

    cfg = load_config(None, ["--model.dim=32", f"--model.n_layers={layers}", "--model.n_heads=2",
                             "--model.n_kv_heads=2", "--model.vocab_size=64", "--model.multiple_of=32",
                             "--training.seq_len=8"])
    dims = ParallelDims.from_config(cfg.parallel, 1)
    dims.build_mesh("cpu")
    model = build_model(model_args(cfg.model))
    parallelize(model, dims, cfg)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    opt = build_optimizer(model, cfg.optimizer, "cpu")
    tokens = torch.randint(0, 64, (1, 8))
    batch, n_valid = Batch(tokens, tokens, None, 8), torch.tensor(8)

    def step() -> None:
        forward_backward(model, batch, n_valid)
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def host_overhead_ms(seconds: float = 1.0) -> tuple[float, float]:
    """(ms per block, ms per step) of training steps whose kernels take no time (1 and 5 blocks)."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{Path(d) / 'pg'}", rank=0, world_size=1)
        try:
            one, five = (_time(_tiny_step(n), seconds, min_runs=10) for n in (1, 5))
        finally:
            dist.destroy_process_group()
    per_block = (five - one) / 4
    return 1e3 * per_block, 1e3 * (one - per_block)


def _collective_worker(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    size = 4 * 2**20  # fp32 elements: 16 MiB gathered / reduced
    x = torch.randn(size)
    shard = torch.randn(size // world)
    results = {}

    def timed(fn: Callable[[], object]) -> float:
        dist.barrier()
        return _time(fn, 0.5, min_runs=3)

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    t_ag = timed(lambda: gather(x, shard))
    t_rs = timed(lambda: dist.reduce_scatter_tensor(shard, x))
    t_ar = timed(lambda: dist.all_reduce(x))
    tiny = torch.zeros(2)
    t_lat = timed(lambda: dist.all_reduce(tiny))
    ring = (world - 1) / world * x.numel() * 4
    results = {"all_gather": ring / t_ag, "reduce_scatter": ring / t_rs, "all_reduce": 2 * ring / t_ar,
               "latency_s": t_lat / (2 * (world - 1))}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def collective_bandwidth(world: int) -> tuple[float, float]:
    """(bus bandwidth GB/s, per-hop latency s) of gloo among ``world`` local processes."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.json")
        mp.start_processes(_collective_worker, args=(world, f"file://{Path(d) / 'pg'}", out), nprocs=world,
                           start_method="spawn")
        r = json.loads(Path(out).read_text())
    bw = statistics.median([r["all_gather"], r["reduce_scatter"], r["all_reduce"]]) / 1e9
    return bw, r["latency_s"]


def calibrate(cache_dir: str = "~/.cache/shardwise", log: Callable[[str], None] = print) -> Hardware:
    """Measure this machine and save it as the ``local`` profile."""
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    rates: dict[str, float] = {}
    bandwidth: dict[int, float] = {}
    old_threads = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            for name, dtype in DTYPES.items():
                for w in GEMM_SIZES:
                    rates[f"{name}@{th}:{w}"] = gemm_tflops(dtype, w)
                for hd in HEAD_DIMS:
                    rates[f"attention_{name}@{th}:{hd}"] = attention_tflops(dtype, hd)
            bandwidth[th] = memory_gbs()
            log(f"  {th} thread(s): bf16 GEMM {rates[f'bf16@{th}:{GEMM_SIZES[-1]}']:.3f} TFLOP/s at width "
                f"{GEMM_SIZES[-1]}, attention {rates[f'attention_bf16@{th}:64']:.3f} at head dim 64, "
                f"memory {bandwidth[th]:.1f} GB/s")
        torch.set_num_threads(1 if cores == 1 else cores)
        per_block, per_step = host_overhead_ms()
        log(f"  host overhead: {per_block:.2f} ms per block, {per_step:.2f} ms per step")
    finally:
        torch.set_num_threads(old_threads)
    coll, latency = {}, []
    for w in WORLDS:
        bw, lat = collective_bandwidth(w)
        coll[str(w)] = bw
        latency.append(lat)
        log(f"  gloo, {w} processes: {bw:.2f} GB/s bus bandwidth, {1e6 * lat:.0f} us per hop")
    hw = Hardware(
        name="local", description=f"this machine: {cores} CPU cores, measured by shardwise calibrate",
        memory_gib=_ram_gib(), memory_bw_gbs=bandwidth[max(threads)], gpus_per_node=cores,
        intra_node_bw_gbs=max(coll.values()), intra_node_latency_us=1e6 * statistics.median(latency),
        inter_node_bw_gbs=max(coll.values()), inter_node_latency_us=1e6 * statistics.median(latency),
        comm_overlap=False, peak_tflops={}, efficiency={"memory": 1.0}, cores=cores,
        thread_tflops=rates, overhead_ms={"per_block": per_block, "per_step": per_step},
        collective_bw_gbs=coll, memory_bw_per_thread_gbs={str(k): v for k, v in bandwidth.items()})
    save_hardware(hw, local_path(cache_dir))
    return hw


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0
