"""Real training steps and kernels that ``shardwise calibrate`` times: host overhead per block and per
step (models too small for their kernels to matter), and the memory-bound work of a real step.

The memory-bound share of a dense step on a CPU is small (about a tenth of the ``PROBE`` step), so
what it runs at cannot be read off the step's time less its *predicted* GEMMs and attention: a 10%
error in the GEMM grid, or the machine's drift between two timings, is most of that remainder (three
calibrations of one AVX2 VM put the efficiency at 1.00, 0.33 and the 0.2 floor). The step is timed
call by call against its own GEMMs and attention run alone, at the shapes the cost model gives
them, and the remainder is the median of those paired differences.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.data.dataset import Batch
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.clip import clip_grad_norm_
from shardwise.plan.activations import shape_of
from shardwise.plan.cost import ComputeTally, block_gemms, fsdp_copy_traffic
from shardwise.plan.estimate import estimate
from shardwise.plan.hardware import Hardware
from shardwise.resolve.checks import load_config, resolve_config
from shardwise.resolve.run import resolve_run
from shardwise.runtime.distributed import init_process_group
from shardwise.trainer.build import build_rank_model
from shardwise.trainer.loss import TokenLoss

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

PROBE = ("--model.dim=192", "--model.n_layers=3", "--model.n_heads=6", "--model.n_kv_heads=6",
         "--model.vocab_size=1024", "--model.multiple_of=64", "--training.seq_len=256",
         "--training.global_batch=4", "--training.micro_batch=4", "--activation_checkpoint.mode=none",
         "--compile.enabled=false")
"""A small dense model whose real training step ``calibrate`` times on one process: a shape none of
the presets or benchmark sets uses (4 x 256 tokens, dim 192, head width 32)."""

MOE_TINY = ("--model.n_experts=4", "--model.moe_top_k=2", "--model.moe_hidden_dim=32",
            "--model.n_dense_layers=0")


def median_seconds(fn: Callable[[], object], seconds: float, min_runs: int = 2) -> float:
    """Median seconds per call of ``fn`` over about ``seconds`` (one warm-up call first)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linear_step(dtype: torch.dtype, k: int, n: int, rows: int) -> Callable[[], None]:
    """A linear layer's forward and backward as the model calls it (``F.linear``: the output, the
    input gradient and the weight gradient) on ``rows`` rows, ``k`` inputs, ``n`` outputs."""
    w = torch.randn(n, k).to(dtype).requires_grad_()
    x = torch.randn(rows, k).to(dtype).requires_grad_()
    grad = torch.randn(rows, n).to(dtype)

    def step() -> None:
        F.linear(x, w).backward(grad)
        x.grad = w.grad = None
    return step


def attention_keys(seq: int, causal: bool = True) -> int:
    """Keys of a timed attention call over ``seq`` queries: all of them causal; unmasked, half, as
    a load-balanced ring's calls off its diagonal see (S/cp queries against S/2cp keys)."""
    return seq if causal else max(1, seq // 2)


def attention_step(dtype: torch.dtype, batch: int, heads: int, seq: int, head_dim: int,
                   causal: bool = True) -> Callable[[], None]:
    """Causal SDPA forward and backward over ``seq`` positions; not ``causal``: ``seq`` queries
    against ``seq // 2`` keys unmasked, as a load-balanced ring attention's steps off the diagonal."""
    q = torch.randn(batch, heads, seq, head_dim).to(dtype).requires_grad_()
    keys = attention_keys(seq, causal)
    k, v = (torch.randn(batch, heads, keys, head_dim).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(batch, heads, seq, head_dim).to(dtype)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)
        q.grad = k.grad = v.grad = None
    return step


def tiny_step(layers: int, layout: tuple[str, ...] = (), device: str = "cpu") -> Callable[[], None]:
    """A training step (forward, backward, clipping, AdamW) of a dim-32 model with ``layers``
    blocks through the trainer's own parallelization and loss, on the current process group
    (``layout``: parallel or other overrides such as ``--parallel.tp=2``)."""
    return _train_step(["--model.dim=32", f"--model.n_layers={layers}", "--model.n_heads=2",
                        "--model.n_kv_heads=2", "--model.vocab_size=64", "--model.multiple_of=32",
                        "--training.seq_len=8", *layout], sequences=1, device=device)


def _train_step(overrides: list[str], sequences: int, device: str = "cpu") -> Callable[[], None]:
    """A training step on ``sequences`` sequences of the model ``overrides`` configure, on the
    current process group (``device``: ``cuda`` for bench/gpu_model.py's host-time probe; the step
    then ends by waiting for the GPU)."""
    import torch.distributed as dist

    cfg = resolve_config(load_config(None, overrides), device)
    run = resolve_run(cfg, dist.get_world_size())
    run.dims.build_mesh(device)
    model = build_rank_model(run, device)
    opt = build_optimizer(model, cfg.optimizer, device, run.model.moe_router_lr_scale)
    b, s, vocab = sequences, cfg.training.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (b, s), device=device)
    batch, n_valid = Batch(tokens, tokens, None, b * s), torch.tensor(b * s, device=device)
    wait = torch.cuda.synchronize if device == "cuda" else dist.barrier

    def step() -> None:
        TokenLoss(run.loss_chunk)(model, batch, n_valid)
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        wait()
    return step


def probe_kernels(overrides: list[str]) -> Callable[[], None]:
    """The GEMMs (forward and backward, at the widths and rows the cost model gives each block and
    the output head) and the causal attention of one 1-rank step of the model ``overrides``
    configure, run back to back."""
    cfg = resolve_config(load_config(None, overrides), "cpu")
    shape = shape_of(resolve_run(cfg, 1, detect_device=False))
    a, dtype = shape.args, DTYPES[cfg.training.mixed_precision]
    calls = [linear_step(dtype, k, n, rows) for layer in range(a.n_layers)
             for _, k, n, _, _, rows in block_gemms(shape, cfg, layer)]
    rows = min(shape.loss_chunk or shape.tokens, shape.tokens)
    calls += [linear_step(dtype, a.dim, a.vocab_size, rows)] * (shape.tokens // rows)
    calls += [attention_step(dtype, shape.mb, a.n_heads, shape.seq, a.head_dim)] * a.n_layers

    def run() -> None:
        for call in calls:
            call()
    return run


def _paired(step: Callable[[], None], part: Callable[[], None], seconds: float,
            min_runs: int) -> tuple[float, float]:
    """(median seconds of ``step``, median of ``step`` less ``part`` called right after it): a
    drift of the machine slower than one call lands on both halves of a difference."""
    step(), part()
    steps, diffs = [], []
    start = time.perf_counter()
    while len(steps) < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        part()
        steps.append(t1 - t0)
        diffs.append((t1 - t0) - (time.perf_counter() - t1))
    return statistics.median(steps), statistics.median(diffs)


def host_overhead_ms(seconds: float = 1.0) -> tuple[float, float, float, float, float]:
    """(ms per block, ms per step, ms per MoE block) of training steps whose kernels take no time
    (1 and 5 blocks; an MoE block's routing, token sort and grouped GEMMs are many more small ops),
    and the seconds of one real step of the ``PROBE`` model and of its part beyond its GEMMs and
    attention (:func:`probe_kernels`), timed in pairs."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        init_process_group("gloo", init_method=f"file://{Path(d) / 'pg'}", rank=0, world_size=1)
        try:
            one, five = (median_seconds(tiny_step(n), seconds, min_runs=10) for n in (1, 5))
            moe_one, moe_five = (median_seconds(tiny_step(n, MOE_TINY), seconds, min_runs=10) for n in (1, 5))
            probe, rest = _paired(_train_step(list(PROBE), 4), probe_kernels(list(PROBE)), 3 * seconds, 7)
        finally:
            dist.destroy_process_group()
    per_block = (five - one) / 4
    # (the step's own part is a small difference of noisy timings, which can come out negative)
    return 1e3 * per_block, max(0.0, 1e3 * (one - per_block)), 1e3 * (moe_five - moe_one) / 4, probe, rest


def memory_efficiency(hw: Hardware, rest_seconds: float) -> float:
    """The fraction of the measured elementwise bandwidth a real training step's memory-bound work
    reaches: what the ``PROBE`` step took beyond its GEMMs and attention (``rest_seconds``, measured)
    and its host time (costed on ``hw``, just measured), against what its memory-bound work and
    optimizer cost at the microbenchmark's bandwidth. A step's eager elementwise ops --
    broadcasts, fp32 upcasts, complex RoPE products, casts, small reductions -- run below a plain
    add's rate. FSDP's copies are left out of both sides: they are a few large copies, costed at the
    microbenchmark's rate (:meth:`Hardware.memory_bw`). Clamped to [0.2, 1]."""
    cfg = resolve_config(load_config(None, list(PROBE)), "cpu")
    est = estimate(cfg, 1, hw)
    parts = est.time.ranks[0].compute
    copies = ComputeTally(hw, 1, cfg.run.cpu_memory_cache)
    fsdp_copy_traffic(copies, est.run, est.states[0], shape_of(est.run))
    memory = parts["memory-bound"] + parts["optimizer"] - copies.memory
    rest = rest_seconds - parts["host"] - copies.memory
    return min(1.0, max(0.2, memory / rest)) if rest > 0 else 1.0
