"""Peak memory and step time of one training step, side by side, one fresh process per row:

- ``loss``: plain logits + cross-entropy vs the chunked fused projection + loss
  (``training.loss_chunk``) at vocabularies of 32k and 128k (a small body, so the head dominates);
- ``optimizer``: AdamW with fp32 vs bf16 moments (``optimizer.state_dtype``): state bytes per
  parameter, counted from the tensors;
- ``ac``: activation checkpointing none / selective / selective_half / layer / full
  (``activation_checkpoint.mode``);
- ``compile``: blocks eager vs ``torch.compile`` (``compile.enabled``);
- ``trainer``: the trainer's own ``train_step`` on the 125m preset (``--preset``), bf16, one rank:
  the step as it was before the throughput work (plain loss, the C library's malloc, eager) against
  the defaults (fused loss, ``run.cpu_memory_cache``), eager and compiled.

Peak memory is the CUDA allocator's peak on GPUs; on CPU it is the process RSS high-water mark, and
for eager rows also torch's MemTracker peak of live tensor bytes (exact, no allocator or library
noise; it cannot see inside compiled kernels). For the optimizer, ac and compile suites the step
times come from one more process that builds every row's model and interleaves their steps (A B C
A B C ...), so a slow spell of a shared host hits all rows alike: median wall time and median CPU
seconds per step. The loss suite times each row in its own process.

    python bench/memory.py                       # every suite, CPU, fp32
    python bench/memory.py --suite ac --device cuda --dtype bf16 --batch 8 --seq 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time

VOCABS = (32000, 128256)


def build(row: dict, a: argparse.Namespace) -> tuple:
    """(step function, model, optimizer) for one configuration: ``row`` has vocab, dim, layers,
    chunk, state_dtype, ac, compile."""
    import torch

    from shardwise.config.schema import ActivationCheckpointConfig, OptimizerConfig
    from shardwise.models.transformer import build_model, init_weights
    from shardwise.optim.adamw import build_optimizer
    from shardwise.parallel.ac import apply_ac
    from shardwise.parallel.compile import apply_compile

    device = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    model = build_model(shape(row, a.seq), device=device)
    if dtype != torch.float32:
        model.to(dtype)
    init_weights(model, 0)  # (after the cast: it rebuilds the fp32 RoPE table)
    apply_ac(model, ActivationCheckpointConfig(mode=row["ac"]))
    apply_compile(model, row["compile"])
    opt = build_optimizer(model, OptimizerConfig(lr=1e-4, state_dtype=row["state_dtype"]), a.device)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, row["vocab"], (a.batch, a.seq), generator=g, device=device)
    labels = torch.randint(0, row["vocab"], (a.batch, a.seq), generator=g, device=device)

    def step() -> None:
        if row["chunk"]:
            loss = model(tokens, labels=labels, loss_chunk=row["chunk"]) / labels.numel()
        else:
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return step, model, opt


def trainer_step(row: dict, a: argparse.Namespace) -> tuple:
    """(step function, model, optimizer): the trainer's train_step, one rank, bf16, ``row`` says
    the loss, the allocator setting and compile."""
    import torch

    from shardwise.config.schema import Config
    from shardwise.data.dataset import Batch
    from shardwise.models import PRESETS
    from shardwise.models.transformer import build_model, init_weights
    from shardwise.optim.adamw import build_optimizer
    from shardwise.optim.lr import build_lr_scheduler
    from shardwise.parallel.dims import ParallelDims
    from shardwise.parallel.parallelize import parallelize
    from shardwise.resolve.run import ResolvedRun, loss_chunk_tokens
    from shardwise.runtime.distributed import init_distributed
    from shardwise.runtime.machine import keep_freed_cpu_memory
    from shardwise.trainer.loss import TokenLoss
    from shardwise.trainer.train import train_step

    init_distributed("cpu", cache_cpu_memory=row["cache"])
    keep_freed_cpu_memory(row["cache"])
    args = PRESETS[a.preset]
    cfg = Config()
    cfg.training.global_batch, cfg.training.seq_len = a.batch, a.seq
    cfg.training.mixed_precision, cfg.training.loss = "bf16", row["loss"]
    dims = ParallelDims.from_config(cfg.parallel, 1)
    dims.build_mesh("cpu")
    chunk = loss_chunk_tokens(cfg.training, args.vocab_size, 1, 1, a.batch * a.seq)
    run = ResolvedRun(cfg, dims, args, a.batch, 1, chunk,
                      "bf16", "cpu", compile=row["compile"])
    model = build_model(args)
    parallelize(model, dims, cfg, run.compile)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    opt = build_optimizer(model, cfg.optimizer, "cpu")
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, 1000)
    loss = TokenLoss(run.loss_chunk, compiled=run.compile)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq + 1), generator=g)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], None, a.batch * a.seq)
    return (lambda: train_step(model, opt, sched, [batch], run, loss).loss.item()), model, opt


def child(row: dict, a: argparse.Namespace) -> dict:
    """Memory of one configuration, alone in this process (and its own step times)."""
    import torch

    from shardwise.observe.memory import peak_memory_gib
    from shardwise.optim.adamw import state_bytes_per_param

    step, model, opt = (trainer_step if "cache" in row else build)(row, a)
    times = []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        step()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    out = {"peak_gib": peak_memory_gib(torch.device(a.device)), "step_s": statistics.median(times),
           "state_bytes_per_param": state_bytes_per_param(opt), "tensor_peak_gib": None}
    if a.device == "cpu" and not row["compile"]:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        out["tensor_peak_gib"] = peak["Total"] / 2**30
    return out


def time_child(table: list[dict], a: argparse.Namespace) -> list[dict]:
    """Step times of several configurations in one process, their steps interleaved (A B C A B C
    ...), so a slow spell of a shared host hits them all alike."""
    built = [(trainer_step if "cache" in row else build)(row, a)[0] for row in table]
    for step in built:
        for _ in range(a.warmup):
            step()
    wall: list[list[float]] = [[] for _ in built]
    cpu: list[list[float]] = [[] for _ in built]
    for _ in range(a.steps):
        for i, step in enumerate(built):
            t, c = time.perf_counter(), time.process_time()
            step()
            wall[i].append(time.perf_counter() - t)
            cpu[i].append(time.process_time() - c)
    return [{"step_s": statistics.median(w), "cpu_s": statistics.median(c)}
            for w, c in zip(wall, cpu, strict=True)]


def rows(suite: str, a: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label, configuration) of each row of a suite."""
    base = {"vocab": 32000, "dim": a.dim, "layers": a.layers, "chunk": 0, "state_dtype": "fp32",
            "ac": "none", "compile": False}
    if suite == "loss":
        return [(f"vocab {v:,}, " + (f"chunked ({c} tokens)" if c else "plain logits + F.cross_entropy"),
                 {**base, "vocab": v, "dim": 256, "layers": 2, "chunk": c})
                for v in VOCABS for c in (0, a.chunk)]
    body = {**base, "vocab": 8192, "chunk": a.chunk}  # a deeper body so the blocks dominate
    if suite == "trainer":
        settings = (("before: plain loss, C-library malloc, eager", "plain", False, False),
                    ("defaults: fused loss, cached malloc, eager", "auto", True, False),
                    ("defaults, compiled", "auto", True, True))
        return [(label, {**base, "loss": loss, "cache": cache, "compile": comp})
                for label, loss, cache, comp in settings]
    if suite == "optimizer":
        return [(f"AdamW {d} moments", {**body, "state_dtype": d}) for d in ("fp32", "bf16")]
    if suite == "ac":
        return [(f"activation_checkpoint.mode={m}", {**body, "ac": m})
                for m in ("none", "selective", "selective_half", "layer", "full")]
    return [(f"compile.enabled={c}", {**body, "compile": c}) for c in (False, True)]


def shape(row: dict, seq: int):  # noqa: ANN201 -- ModelArgs
    """The suite's model: the debug preset at the row's width, depth and vocabulary."""
    from shardwise.models import PRESETS

    return dataclasses.replace(PRESETS["debug"], vocab_size=row["vocab"], dim=row["dim"],
                               n_layers=row["layers"], n_heads=row["dim"] // 64,
                               n_kv_heads=row["dim"] // 64, max_seq_len=seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="all", choices=["all", "loss", "optimizer", "ac", "compile", "trainer"])
    p.add_argument("--preset", default="125m", help="model of the trainer suite")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512, help="body width of the optimizer/ac/compile suites")
    p.add_argument("--layers", type=int, default=8, help="blocks of the optimizer/ac/compile suites")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="training.loss_chunk of the chunked runs")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--time-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child), a)))
        return
    if a.time_child:
        print(json.dumps(time_child(json.loads(a.time_child), a)))
        return
    print(f"{a.device}, {a.dtype}, {a.batch} x {a.seq} = {a.batch * a.seq} tokens per step, median of "
          f"{a.steps} steps after {a.warmup} warm-up\n")
    suites = ["loss", "optimizer", "ac", "compile"] if a.suite == "all" else [a.suite]
    keys = ("device", "dtype", "batch", "seq", "steps", "warmup", "preset")
    args = [f"--{k}={getattr(a, k)}" for k in keys]
    for suite in suites:
        table = rows(suite, a)
        r0 = table[0][1]
        from shardwise.observe.flops import num_params

        if suite == "trainer":
            from shardwise.models import PRESETS

            print(f"### trainer: the {a.preset} preset, {num_params(PRESETS[a.preset]) / 1e6:.1f}M "
                  "parameters, bf16, train_step on one rank\n")
        else:
            print(f"### {suite}: body dim {r0['dim']} x {r0['layers']} blocks, vocab {r0['vocab']:,}, "
                  f"{num_params(shape(r0, a.seq)) / 1e6:.1f}M parameters\n")
        print("| configuration | peak RSS (GiB) | tensor peak (GiB) | step time (s) | CPU time (s) | "
              "optimizer bytes/param |")
        print("|---|---|---|---|---|---|")
        results = []
        for _, row in table:
            argv = [sys.executable, __file__, "--child", json.dumps(row), *args]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
        if suite not in ("loss", "trainer"):  # times from one process, steps interleaved
            # (memory stays per process; the trainer's rows set the process's malloc: one each)
            argv = [sys.executable, __file__, "--time-child", json.dumps([r for _, r in table]), *args]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            for r, t in zip(results, json.loads(out.strip().splitlines()[-1]), strict=True):
                r.update(t)
        for (label, _), r in zip(table, results, strict=True):
            tensor = f"{r['tensor_peak_gib']:.3f}" if r["tensor_peak_gib"] is not None else "n/a"
            cpu = f"{r['cpu_s']:.2f}" if "cpu_s" in r else "-"
            print(f"| {label} | {r['peak_gib']:.2f} | {tensor} | {r['step_s']:.2f} | {cpu} | "
                  f"{r['state_bytes_per_param']:.1f} |", flush=True)
        print()
        if suite == "trainer":
            for (label, _), r in zip(table[1:], results[1:], strict=True):
                tensor = (f", tensor peak {r['tensor_peak_gib'] / results[0]['tensor_peak_gib']:.3f}x"
                          if r["tensor_peak_gib"] else "")
                print(f"{label}: peak RSS {r['peak_gib'] / results[0]['peak_gib']:.3f}x{tensor}, step "
                      f"time {r['step_s'] / results[0]['step_s']:.2f}x of {table[0][0]}")
        elif suite == "loss":
            for i, vocab in enumerate(VOCABS):
                plain, chunked = results[2 * i], results[2 * i + 1]
                print(f"vocab {vocab:,}: peak {chunked['peak_gib'] / plain['peak_gib']:.2f}x of plain, "
                      f"step time {chunked['step_s'] / plain['step_s']:.2f}x")
        else:
            ref = results[0]
            key = "tensor_peak_gib" if all(r["tensor_peak_gib"] for r in results) else "peak_gib"
            for (label, _), r in zip(table[1:], results[1:], strict=True):
                print(f"{label}: {key} {r[key] / ref[key]:.2f}x, step time "
                      f"{r['step_s'] / ref['step_s']:.2f}x, CPU time {r['cpu_s'] / ref['cpu_s']:.2f}x "
                      f"of {table[0][0]}")
        print()


if __name__ == "__main__":
    main()
