"""Training throughput of shardwise's step vs a plain hand-written PyTorch loop, side by side.

Both train the same ``Transformer`` on the same batches of the shipped corpus in one process:

- **shardwise**: the trainer's own ``train_step`` -- FSDP2 on a 1-rank mesh with bf16 mixed precision
  (fp32 master weights, bf16 compute, fp32 gradient reduction), global-token loss normalization,
  float64 global-norm clipping, fused AdamW, LR scheduler.
- **plain**: fp32 parameters under ``torch.autocast(bfloat16)``, mean cross-entropy, torch's
  ``clip_grad_norm_``, fused AdamW -- what one would write by hand.

Steps alternate between the two (after warm-up) so machine noise hits both alike; the figure is the
median tokens/s. MFU uses the PaLM convention (shardwise.observe.flops) against the measured bf16
GEMM peak of this machine, measured in the same run (best of 1024^2 and 2048^2 matmuls).

The trainer makes glibc's malloc keep freed memory (``run.cpu_memory_cache``); a hand-written loop
runs with the C library's defaults, so the plain steps switch the allocator back to those while
they run. A third variant, the plain loop with the trainer's allocator setting, shows how much of
the difference that setting alone makes.

    python bench/throughput.py                      # debug (8 x 2048) and 125m (4 x 1024)
    python bench/throughput.py --presets debug --steps 3
    python bench/throughput.py --presets 125m --profile 25   # and the top 25 ops of one step
    python bench/throughput.py --device cuda --presets 1b --shape 4 2048 --float8 rowwise   # a GPU

On a GPU the peak is the measured bf16 GEMM of 8192^2 matrices, the steps end with a synchronizing
``.item()`` in both variants, and the allocator switch does not apply (no "plain + cached" row).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.config.schema import Config
from shardwise.data.dataset import IGNORE_INDEX, PackedLoader, open_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.models import PRESETS
from shardwise.models.transformer import build_model, init_weights
from shardwise.observe.flops import flops_per_token, num_params
from shardwise.observe.peak import measure_gemm_tflops
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.parallelize import parallelize
from shardwise.resolve.run import ResolvedRun, compile_run, loss_chunk_tokens
from shardwise.runtime.distributed import init_distributed
from shardwise.runtime.machine import keep_freed_cpu_memory
from shardwise.trainer.loss import TokenLoss
from shardwise.trainer.train import train_step

SHAPES = {"debug": (8, 2048), "125m": (4, 1024)}  # (sequences per step, sequence length) on CPU
LONG_RUN = 1000  # training.steps of the run whose steady state this measures (compile.enabled=auto)


def bench_preset(name: str, steps: int, warmup: int, peak: float, profile: int = 0,
                 compile_blocks: str = "auto", device: str = "cpu", shape: tuple[int, int] | None = None,
                 float8: str = "off", loss_kind: str = "auto", loss_chunk: int = 0,
                 profile_json: str = "") -> dict[str, float]:
    batch, seq = shape or SHAPES[name]
    args = dataclasses.replace(PRESETS[name], max_seq_len=max(seq, PRESETS[name].max_seq_len))
    cpu = device == "cpu"
    # A fresh Dynamo per preset, as a training run has: a second model's shapes would otherwise hit
    # the first one's cache entries and recompile with dynamic shapes (automatic dynamic).
    torch._dynamo.reset()
    cfg = Config()
    cfg.training.global_batch, cfg.training.seq_len = batch, seq
    cfg.training.steps = LONG_RUN  # what compile.enabled=auto decides for a training run
    cfg.compile.enabled = {"auto": "auto", "true": True, "false": False}[compile_blocks]
    cfg.training.loss, cfg.training.loss_chunk = loss_kind, loss_chunk
    cfg.float8.enabled, cfg.float8.recipe = float8 != "off", "tensorwise" if float8 == "off" else float8
    dims = ParallelDims.from_config(cfg.parallel, 1)
    dims.build_mesh(device)
    corpus = open_corpus(cfg.data, load_tokenizer(""))
    # The shipped tokenizer's ids index any preset's vocabulary; a larger preset simply never sees
    # its upper rows (the GEMMs and the loss are the preset's full size all the same).
    loader = PackedLoader(corpus.train, seq, batch, batch, 0, 1, seed=0, document_mask=False,
                          device=device)
    batches = [loader.next_step() for _ in range(warmup + steps)]

    compiled = compile_run(cfg, dims, device)[0]
    run = ResolvedRun(cfg, dims, args, micro_batch=batch, micro_batches=1,
                      loss_chunk=loss_chunk_tokens(cfg.training, args.vocab_size, 1, 1, batch * seq),
                      precision="bf16",
                      device_type=device, compile=compiled)
    loss = TokenLoss(run.loss_chunk, compiled=run.compile)
    ours = build_model(args)
    cfg.training.mixed_precision = "bf16"
    parallelize(ours, dims, cfg, run.compile)
    ours.to_empty(device=device)
    init_weights(ours, 0)
    opt = build_optimizer(ours, cfg.optimizer, device)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, warmup + steps)

    plain = build_model(args, device=device)
    init_weights(plain, 0)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)

    def step_ours(mbs):
        train_step(ours, opt, sched, mbs, run, loss).loss.item()

    def step_plain(mbs, cached_malloc: bool = False):
        (b,) = mbs
        if cpu:
            keep_freed_cpu_memory(cached_malloc)  # a hand-written loop gets the C library's malloc
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = plain(b.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b.labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        popt.step()
        popt.zero_grad(set_to_none=True)
        loss.item()
        if cpu:
            keep_freed_cpu_memory(True)

    times: dict[str, list[float]] = {"shardwise": [], "plain": []}
    if cpu:
        times["plain_cached"] = []
    first: dict[str, float] = {}  # the first step of each (the compile, if any, is in it)
    # GPU: the step's peak above what was allocated when it started (both models' states are
    # resident; gradients, activations and temporaries are what a step adds), max over the steps
    rise: dict[str, float] = {}
    # shardwise runs right after the plain loop, whose C-library malloc gave the cached memory
    # back to the OS: its step pays that (the order is against shardwise, not for it).
    variants = (("plain_cached", lambda mbs: step_plain(mbs, cached_malloc=True)),
                ("plain", step_plain), ("shardwise", step_ours))[0 if cpu else 1:]
    for i, mbs in enumerate(batches):
        for label, fn in variants:
            if not cpu:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn(mbs)
            if not cpu:
                rise[label] = max(rise.get(label, 0.0), (torch.cuda.max_memory_allocated() - base) / 2**30)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
            elif i == 0:
                first[label] = time.perf_counter() - t0
    fpt = flops_per_token(args, seq)
    out = {"params_m": num_params(args) / 1e6, "tokens_per_step": batch * seq, "compiled": compiled,
           "shardwise_first_s": first["shardwise"], "plain_first_s": first["plain"],
           **{f"{label}_rise_gib": r for label, r in rise.items()}}
    for label, ts in times.items():
        tps = batch * seq / statistics.median(ts)
        out[f"{label}_tps"] = tps
        out[f"{label}_mfu"] = tps * fpt / (peak * 1e12)
    out["ratio"] = out["shardwise_tps"] / out["plain_tps"]
    if cpu:
        out["ratio_cached"] = out["shardwise_tps"] / out["plain_cached_tps"]
    if profile:
        print_profile(name, lambda: step_ours(batches[-1]), profile, device, profile_json,
                      {"batch": batch, "seq": seq, "tokens_per_s": out["shardwise_tps"]})
    return out


def print_profile(name: str, step: Callable[[], None], rows: int, device: str = "cpu",
                  dump: str = "", about: dict | None = None) -> None:
    """Top ops of one shardwise step, after the timed ones, by self CPU time; on a GPU also the top
    kernels and how much of the step's wall time the GPU was busy (the rest is host overhead).
    ``dump``: also write every kernel and every op by input shape to this JSON file, with
    ``about`` (the shape, and the timed steps' median tokens/s)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=bool(dump)) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    tables = [("op", "self CPU", [e for e in events if e.self_cpu_time_total > 0], "self_cpu_time_total")]
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        print(f"\n{name}: one shardwise step, {wall:.3f} s wall under the profiler; GPU kernels "
              f"{busy:.3f} s ({100 * busy / wall:.0f}% of the wall time)")
        tables.insert(0, ("kernel", "GPU", kernels, "self_device_time_total"))
    for what, clock, evs, attr in tables:
        total = sum(getattr(e, attr) for e in evs) / 1e6
        print(f"\n{name}: top {what}s by {clock} time ({total:.3f} s in all, {wall:.3f} s wall)\n")
        print(f"| {what} | calls | {clock} s | share |")
        print("|---|---|---|---|")
        for e in sorted(evs, key=lambda e: -getattr(e, attr))[:rows]:
            s = getattr(e, attr) / 1e6
            print(f"| {e.key[:90]} | {e.count} | {s:.4f} | {100 * s / total:.1f}% |")
    print()
    if dump:
        kernels = [{"name": e.key, "calls": e.count, "device_s": e.self_device_time_total / 1e6}
                   for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        ops = [{"name": e.key, "shapes": str(e.input_shapes), "calls": e.count,
                "device_s": e.device_time_total / 1e6, "cpu_s": e.cpu_time_total / 1e6}
               for e in prof.key_averages(group_by_input_shape=True)
               if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")]
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        Path(dump).write_text(json.dumps({"preset": name, **(about or {}), "device": device_name,
                                          "torch": torch.__version__, "profiled_wall_s": wall,
                                          "kernels": kernels, "ops": ops}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["debug", "125m"], choices=list(PRESETS))
    p.add_argument("--shape", nargs=2, type=int, metavar=("SEQUENCES", "SEQ_LEN"),
                   help="tokens per step (default: debug 8 x 2048, 125m 4 x 1024)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", choices=("auto", "true", "false"), default="auto",
                   help=f"shardwise's compile.enabled (auto: as a run of {LONG_RUN} steps resolves it)")
    p.add_argument("--loss", choices=("auto", "fused", "plain"), default="auto",
                   help="shardwise's training.loss (the plain loop always uses logits + cross-entropy)")
    p.add_argument("--loss-chunk", type=int, default=0, help="shardwise's training.loss_chunk")
    p.add_argument("--float8", choices=("off", "tensorwise", "rowwise"), default="off",
                   help="shardwise's float8 recipe (the plain loop stays bf16)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also profile one shardwise step per preset and print its top ROWS ops")
    p.add_argument("--profile-json", default="", metavar="FILE",
                   help="with --profile: also write every kernel and op (by input shape) to FILE")
    a = p.parse_args()
    for name in a.presets:
        if a.shape is None and name not in SHAPES:
            p.error(f"--presets {name} needs --shape SEQUENCES SEQ_LEN (defaults: {', '.join(SHAPES)})")
    init_distributed(a.device)
    dev = torch.device(a.device)
    # The peak is measured here, beside the steps, not read from the cache: the same machine
    # name can hide another CPU (or another clock) from one session to the next.
    sizes = (1024, 2048) if a.device == "cpu" else (8192,)
    peak = max(measure_gemm_tflops(torch.bfloat16, dev, n) for n in sizes)
    where = (f"{torch.get_num_threads()} threads" if a.device == "cpu"
             else torch.cuda.get_device_name(dev))
    print(f"torch {torch.__version__}, {where}, MFU peak {peak:.3f} TFLOP/s (bf16 GEMM measured in "
          f"this run), float8 {a.float8}, loss {a.loss}\n")
    cpu = a.device == "cpu"
    head = ["preset", "params", "tokens/step", "shardwise tok/s", "plain tok/s", "shardwise / plain",
            "shardwise MFU", "plain MFU"]
    head += ["plain + cached malloc tok/s", "shardwise / that"] if cpu else []
    head += ["compiled", "first step s: shardwise, plain"]
    head += [] if cpu else ["step peak GiB above its start: shardwise, plain"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in a.presets:
        shape = tuple(a.shape) if a.shape else None
        r = bench_preset(name, a.steps, a.warmup, peak, a.profile, a.compile, a.device, shape, a.float8,
                         a.loss, a.loss_chunk, a.profile_json)
        b, s = shape or SHAPES[name]
        cells = [name, f"{r['params_m']:.1f}M", f"{b}x{s}", f"{r['shardwise_tps']:,.0f}",
                 f"{r['plain_tps']:,.0f}", f"{r['ratio']:.3f}", f"{100 * r['shardwise_mfu']:.1f}%",
                 f"{100 * r['plain_mfu']:.1f}%"]
        if cpu:
            cells += [f"{r['plain_cached_tps']:,.0f}", f"{r['ratio_cached']:.3f}"]
        cells += ["yes" if r["compiled"] else "no", f"{r['shardwise_first_s']:.1f}, {r['plain_first_s']:.1f}"]
        if not cpu:
            cells.append(f"{r['shardwise_rise_gib']:.2f}, {r['plain_rise_gib']:.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
