"""The planner's GPU step-time terms against one real GPU: GEMM time by shape, and host time per op.

The step-time model (shardwise.plan) costs a GEMM by output tiles and waves over the GPU's
multiprocessors (``hardware.gemm_seconds``) and a block's host side at ``host_us_per_op`` per ATen
op (``cost.host_ops``); both were written from the literature. This measures them:

- **GEMMs**: ``F.linear`` in bf16 on random data for the shapes training runs -- the 1B/8B/70B/405B
  projections at 8192 tokens, their tensor-parallel slices, a weight gradient, and few-row calls
  (an expert's share of the tokens). Each is set beside the tile model's time on ``--hardware``
  and beside a flat efficiency (every GEMM at the profile's ``matmul`` fraction of peak). The
  summary gives the efficiency that centres each model on these shapes and the spread that is
  left: the shape dependence the tile model gets right or wrong.
- **Attention**: causal SDPA forward + backward per head width and sequence length, as a fraction
  of the bf16 peak, against the profile's flat ``attention`` efficiency.
- **Host time**: training steps of a dim-32 model (kernels take next to nothing) through the
  trainer's own parallelization on a one-rank mesh, 1, 5 and 9 blocks, eager and compiled; the
  per-block difference over the ATen ops an eager block dispatches (``cost.host_ops``) is the host
  time per op (``host_us_per_op``), and the compiled figure says whether compiled blocks cost the
  host less.

    python bench/gpu_model.py --hardware h200 --out gpu_model.json    # on a GPU machine
    python bench/gpu_model.py --device cpu --quick                    # a smoke run of the code
    python bench/gpu_model.py --step-kernels bench/results/h100_1b_4x2048_kernels.json  # no GPU

The last sorts a profiled training step's kernels (``bench/throughput.py --profile-json``) into
the planner's compute terms and sets each beside the profile's estimate of that step.

On CPU the figures mean nothing for a GPU; ``--quick`` times a few small shapes only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from shardwise.models import ModelArgs  # noqa: E402
from shardwise.plan.cost import host_ops  # noqa: E402
from shardwise.plan.hardware import (  # noqa: E402
    BYTES_PER,
    Hardware,
    attention_efficiency,
    gemm_seconds,
    load_hardware,
)
from shardwise.plan.probes import median_seconds, tiny_step  # noqa: E402
from shardwise.runtime.distributed import init_distributed  # noqa: E402


def _shapes() -> list[tuple[str, int, int, int]]:
    """(label, rows m, inputs k, outputs n) of ``F.linear``: (m x k) @ (k x n)."""
    t = 8192  # tokens of one micro-batch (one 8192-token sequence, as the published runs)
    out = [(f"square {s}", s, s, s) for s in (8192, 4096, 2048, 1024)]
    dims = {"1b": (2048, 512, 8192), "8b": (4096, 1024, 14336), "70b": (8192, 1024, 28672),
            "405b": (16384, 1024, 53248)}  # (dim, kv width, ffn hidden)
    for name, (dim, kv, ffn) in dims.items():
        for tp in (1, 2, 4, 8):
            if name in ("1b",) and tp > 1 or name == "405b" and tp != 8:
                continue
            tag = f"{name} tp{tp}" if tp > 1 else name
            out += [(f"{tag} wq", t, dim, dim // tp), (f"{tag} wk", t, dim, kv // tp),
                    (f"{tag} w1", t, dim, ffn // tp), (f"{tag} w2", t, ffn // tp, dim)]
    out += [("8b head", t, 4096, 128256), ("8b w1 weight grad", 4096, t, 14336),
            ("8b w2 weight grad", 14336, t, 4096)]
    for rows in (128, 256, 512, 1024, 2048):
        out += [(f"{rows} rows 2048x2048", rows, 2048, 2048), (f"{rows} rows 4096x14336", rows, 4096, 14336)]
    return out


def _gemm_seconds_measured(m: int, k: int, n: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of one ``F.linear`` (m x k) x (n x k)^T in bf16 on random data: launched from
    Python back to back (what eager code gets: a small GEMM can wait on its launch), and replayed
    from a CUDA graph (the kernels alone). On CPU both are the plain call."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    if device.type != "cuda":
        t = median_seconds(lambda: F.linear(x, w), 0.05)
        return t, t
    for _ in range(3):
        F.linear(x, w)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.linear(x, w)
    torch.cuda.synchronize()
    reps = max(5, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        F.linear(x, w)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                F.linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    launched = _event_seconds(lambda: F.linear(x, w), device, calls=reps)
    return launched, _event_seconds(graph.replay, device, calls=1) / reps


def gemms(hw_name: str, device: torch.device, quick: bool) -> dict:
    """Every shape measured and predicted; the summary per model."""
    hw = load_hardware(hw_name)
    eff = hw.efficiency.get("matmul_bf16", hw.efficiency["matmul"])
    rate = hw.peak_tflops["bf16"] * eff
    shapes = [s for s in _shapes() if not quick or max(s[1:]) <= 2048]
    rows = []
    for label, m, k, n in shapes:
        measured, kernel = _gemm_seconds_measured(m, k, n, device)
        tile = gemm_seconds(m, k, n, rate, hw.memory_bw(), hw.sms, BYTES_PER["bf16"])
        flat = 2 * m * k * n / (rate * 1e12)
        flops = 2 * m * k * n
        rows.append({"shape": label, "m": m, "k": k, "n": n, "measured_tflops": flops / measured / 1e12,
                     "tile_tflops": flops / tile / 1e12, "flat_tflops": rate,
                     "kernel_tflops": flops / kernel / 1e12, "measured_s": measured, "kernel_s": kernel,
                     "tile_s": tile, "flat_s": flat})
        r = rows[-1]
        print(f"{label:24s} {m:6d} {k:6d} {n:6d}  measured {r['measured_tflops']:7.1f} (graph "
              f"{r['kernel_tflops']:7.1f})  tile model "
              f"{r['tile_tflops']:7.1f}  flat {rate:6.1f} TFLOP/s  measured/tile time "
              f"{measured / tile:5.2f}", flush=True)
    summary = {}
    for model, timing in (("tile", "measured"), ("flat", "measured"), ("tile", "kernel"), ("flat", "kernel")):
        logs = [math.log(r[f"{timing}_s"] / r[f"{model}_s"]) for r in rows]
        centre = statistics.fmean(logs)
        # the profile's matmul efficiency that would centre this model on these shapes
        summary[f"{model} model, {timing} time"] = {"centring_efficiency": eff * math.exp(-centre),
                          "geomean_measured_over_predicted": math.exp(centre),
                          "spread_after_centring": [math.exp(min(logs) - centre),
                                                    math.exp(max(logs) - centre)],
                          "rms_log_error_after_centring": math.sqrt(statistics.fmean(
                              [(x - centre) ** 2 for x in logs]))}
    print(json.dumps(summary, indent=1), flush=True)
    return {"hardware": hw_name, "matmul_efficiency": eff, "rows": rows, "summary": summary}


def attention(hw_name: str, device: torch.device, quick: bool) -> list[dict]:
    """Causal SDPA forward + backward in bf16 (the kernel torch picks, as the model calls it) per head
    width and sequence length, 16,384 tokens per call and 2,048 or 4,096 query width (the head
    widths 64 and 128 at both, 96 and 256 at one); FLOPs counted as the planner does (4 H D per
    query-key pair forward, 2.5x that backward), set against the profile's attention efficiency at
    that shape (``hardware.attention_efficiency``)."""
    hw = load_hardware(hw_name)
    peak = hw.peak_tflops["bf16"]
    out = []
    grid = [(w, d) for w in (2048, 4096) for d in (64, 128)] + [(2048, 96), (4096, 256)]
    for width, head_dim in grid:
        for seq in ((256, 512) if quick else (512, 1024, 2048, 4096, 8192, 16384)):
            heads, batch = width // head_dim, max(1, (512 if quick else 16384) // seq)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)

            def step(q=q, k=k, v=v, grad=grad) -> None:
                # autograd.grad, not .backward(): accumulating into q/k/v.grad would add three
                # elementwise passes that the model's attention does not run (12% at 2048 tokens)
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
            seconds = _event_seconds(step, device)
            flops = 4 * heads * head_dim * batch * seq * (seq + 1) / 2 * 3.5
            rate = flops / seconds / 1e12
            model = attention_efficiency(hw, head_dim, seq)
            out.append({"width": width, "head_dim": head_dim, "seq": seq, "batch": batch,
                        "seconds": seconds, "tflops": rate, "fraction_of_peak": rate / peak,
                        "profile_efficiency": model})
            print(f"attention width {width} head {head_dim:3d} seq {seq:5d} x{batch:2d}: {rate:6.1f} "
                  f"TFLOP/s = {rate / peak:.2f} of peak (profile: {model:.2f})", flush=True)
    return out


def fit_attention(rows: list[dict]) -> dict:
    """The profile's attention terms that best fit measured rows of :func:`attention` (least squared
    log error): ``attention_seq_half`` (to 10 positions), and for each head width the long-sequence
    rate (the geometric mean over its rows given that half), as ``efficiency.attention`` (head
    width 128) and ``attention_head_dim`` (each width relative to 128), to 0.01."""
    best: tuple[float, int, dict[int, float]] = (math.inf, 0, {})
    widths = sorted({r["head_dim"] for r in rows})
    for half in range(0, 4000, 10):
        ceilings, err = {}, 0.0
        for d in widths:
            logs = [math.log(r["fraction_of_peak"] * (r["seq"] + half) / r["seq"]) for r in rows
                    if r["head_dim"] == d]
            ceilings[d] = statistics.fmean(logs)
            err += sum((x - ceilings[d]) ** 2 for x in logs)
        if err < best[0]:
            best = (err, half, ceilings)
    err, half, ceilings = best
    top = math.exp(ceilings[128])
    return {"attention": round(top, 2), "attention_seq_half": half,
            "attention_head_dim": {str(d): round(math.exp(c) / top, 2) for d, c in ceilings.items()},
            "rms_log_error": math.sqrt(err / len(rows))}


# GPU-side ranges the profiler records beside the kernels (compiled graphs, FSDP hooks, the
# optimizer step): they overlap the kernels inside them and are not work of their own.
_RANGES = re.compile(r"^(## |FSDP::|Optimizer\.|ProfilerStep)")
KERNEL_KINDS = {"matmul": re.compile(r"nvjet|gemm|cutlass|xmma|cublas", re.I),
                "attention": re.compile(r"sdpa|flash|fmha|cudnn", re.I),
                "optimizer": re.compile(r"multi_tensor_apply")}
"""The planner's compute terms a kernel's name places it in; every other kernel (Triton's fused
elementwise and norm kernels, copies, casts, reductions) is ``memory-bound``. The optimizer's
kernels include the clipping norm's (``_foreach_norm``), which the planner also counts there."""


def step_kernels(profile: dict, hw: Hardware) -> dict[str, dict[str, float]]:
    """A profiled training step (``bench/throughput.py --profile-json``) by the planner's compute
    terms: measured kernel seconds beside ``estimate``'s on ``hw`` for the same preset and shape,
    and the GPU's idle time (the step's time from the measured tokens/s, less its kernels) beside
    the planner's host term."""
    from shardwise.plan.estimate import estimate
    from shardwise.resolve.checks import load_config, resolve_config

    measured = dict.fromkeys([*KERNEL_KINDS, "memory-bound"], 0.0)
    for k in profile["kernels"]:
        if not _RANGES.match(k["name"]):
            kind = next((n for n, pat in KERNEL_KINDS.items() if pat.search(k["name"])), "memory-bound")
            measured[kind] += k["device_s"]
    batch, seq = profile["batch"], profile["seq"]
    step = batch * seq / profile["tokens_per_s"]
    measured["host"] = step - sum(measured.values())  # (the GPU idle: waiting on the host)
    # (profiles without the key predate parallel.one_rank: FSDP on one rank ran them)
    one_rank = profile.get("one_rank", "fsdp")
    cfg = resolve_config(load_config(None, [
        f"--model.name={profile['preset']}", f"--training.global_batch={batch}", f"--training.seq_len={seq}",
        f"--model.max_seq_len={max(seq, 2048)}", "--training.steps=100000", "--run.device=cuda",
        f"--parallel.one_rank={one_rank}"]), "cuda")
    est = estimate(cfg, 1, hw, exact=False)
    predicted = dict(est.time.ranks[0].compute)
    return {"measured": {**measured, "step": step}, "predicted": {**predicted, "step": est.time.step}}


def _event_seconds(fn, device: torch.device, calls: int = 3) -> float:
    """Median seconds per call of ``fn``: CUDA events around five windows of ``calls`` calls each,
    after two warm-up calls (CPU: wall time)."""
    if device.type != "cuda":
        return median_seconds(fn, 0.05)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def host_time(device: torch.device, seconds: float) -> dict:
    """Host ms per block (eager and compiled) of a model whose kernels take next to nothing, and
    that over ``cost.host_ops``'s count of one block's ops: the host time per op."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64)
    out = {}
    for compiled in (False, True):
        flags = (f"--compile.enabled={str(compiled).lower()}", "--activation_checkpoint.mode=none")
        times = {n: median_seconds(tiny_step(n, flags, device=device.type), seconds, min_runs=10)
                 for n in (1, 5, 9)}
        per_block = (times[9] - times[1]) / 8
        ops = host_ops(args, 0, recomputed=False)
        key = "compiled" if compiled else "eager"

        out[key] = {"ms_by_blocks": {n: 1e3 * t for n, t in times.items()},
                    "dynamo": {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")},
                    "ms_per_block": 1e3 * per_block, "ms_per_step_rest": 1e3 * (times[1] - per_block),
                    "ops_per_block_counted": ops, "us_per_op": 1e6 * per_block / ops}
        print(f"host, {key}: steps of 1/5/9 blocks {[round(1e3 * t, 2) for t in times.values()]} ms; dynamo "
              f"{out[key]['dynamo']}", flush=True)
        print(f"host, {key}: {1e3 * per_block:.3f} ms per block, {1e3 * (times[1] - per_block):.2f} ms "
              f"per step besides; over {ops} ops counted per block: {1e6 * per_block / ops:.2f} us per op",
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100", help="the profile whose GEMM model is checked")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and short timings (smoke run)")
    parser.add_argument("--skip-host", action="store_true")
    parser.add_argument("--only-attention", action="store_true", help="the attention table alone")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--fit-attention", default="", metavar="JSON",
                        help="no GPU: print the attention terms fitted to a saved --out file's table")
    parser.add_argument("--step-kernels", default="", metavar="JSON",
                        help="no GPU: a profiled step (bench/throughput.py --profile-json) by the "
                             "planner's terms, beside --hardware's estimate of it")
    a = parser.parse_args()
    if a.fit_attention:
        print(json.dumps(fit_attention(json.loads(Path(a.fit_attention).read_text())["attention"])))
        return
    if a.step_kernels:
        profile = json.loads(Path(a.step_kernels).read_text())
        r = step_kernels(profile, load_hardware(a.hardware))
        print(f"{profile['preset']} {profile['batch']} x {profile['seq']} on {profile['device']}: ms per "
              f"step, measured kernels against the {a.hardware} profile\n")
        print("| term | measured | predicted | predicted / measured |\n|---|---|---|---|")
        for term, ms in r["measured"].items():
            pred = r["predicted"][term]
            print(f"| {term} | {1e3 * ms:.1f} | {1e3 * pred:.1f} | "
                  + (f"{pred / ms:.2f} |" if ms > 0 else "-- |"))
        return
    env = init_distributed(a.device)
    result: dict = {"device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu",
                    "torch": torch.__version__}
    print(f"{result['device']}, torch {torch.__version__}", flush=True)
    result["attention"] = attention(a.hardware, env.device, a.quick)
    if a.only_attention:
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
        return
    result["gemms"] = gemms(a.hardware, env.device, a.quick)
    if not a.skip_host:
        result["host"] = host_time(env.device, 0.2 if a.quick else 1.0)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
