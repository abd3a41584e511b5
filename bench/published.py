"""Predict torchtitan's published Llama 3.1 H100 runs (ANCHORS.md) and run ``plan`` on the same
setups: memory per GPU and tokens/s per GPU next to the published figures.

Source of the published rows: torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand
Teton hosts: 8 x H100 96 GB HBM2e at 500 W per host, NVLink inside, 400 Gb/s RDMA per GPU; the
``h100-gt`` profile). Each row is the same model, world, sequence length, global and local batch,
activation checkpointing, torch.compile and float8 setting as published, and what torchtitan's code
at the benchmark's commit (9dec370) did where the table is silent: the plain cross-entropy of the
fp32 logits (eager), its per-op selective policy (every second matmul recomputed:
``selective_half``), and as many pipeline micro-batches as stages (405B: 8 of 4 sequences). Async
TP (rows marked) is not something shardwise does, so those rows are predicted without it.

    python bench/published.py                 # the table for docs/planning.md
    python bench/published.py --plan          # also: does plan find a layout predicted to beat it?
    python bench/published.py --fit           # fit the efficiencies on the 8B rows, predict the rest

``--fit`` chooses the profile's free constants -- the matmul efficiency for bf16 and for fp8, the
attention efficiency and the memory-bandwidth efficiency -- to minimise the squared log error of
tokens/s over the 8B rows only (coordinate search in steps of 0.01), and the allocator's reserved
bytes per live byte (``RESERVED_OVER_LIVE``) to minimise that of memory over the same rows (the
geometric mean of published over live), then prints every row with them: the 8B rows are the fit,
the 70B and 405B rows are predictions. Without ``--fit`` the constants are the ones shipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, model, world, global batch, degrees, micro-batch, ac, compile, float8, schedule,
#  published tok/s/GPU, published GiB)
OP_SAC = "selective_half"  # torchtitan's per-op selective policy: every second matmul recomputed

ROWS = [
    ("8B FSDP8", "8b", 8, 16, dict(dp_shard=8), 2, OP_SAC, False, False, "1f1b", 5762, 82.4),
    ("8B FSDP8 +compile", "8b", 8, 16, dict(dp_shard=8), 2, OP_SAC, True, False, "1f1b", 6667, 77.0),
    ("8B FSDP8 +compile +float8", "8b", 8, 16, dict(dp_shard=8), 2, OP_SAC, True, True, "1f1b", 8532,
     76.8),
    ("8B FSDP128", "8b", 128, 256, dict(dp_shard=128), 2, OP_SAC, False, False, "1f1b", 5605, 67.0),
    ("8B FSDP128 +compile +float8", "8b", 128, 256, dict(dp_shard=128), 2, OP_SAC, True, True, "1f1b",
     8380, 61.8),
    ("70B FSDP32 TP8 +compile +float8", "70b", 256, 512, dict(dp_shard=32, tp=8), 16, "full", True, True,
     "1f1b", 829, 71.9),
    ("405B FSDP8 TP8 PP8 1F1B (+async TP)", "405b", 512, 256, dict(dp_shard=8, tp=8, pp=8), 4, "full", True,
     True, "1f1b", 100, 82.5),
    ("405B FSDP8 TP8 PP8 interleaved 1F1B (+async TP)", "405b", 512, 256, dict(dp_shard=8, tp=8, pp=8), 4,
     "full", True, True, "interleaved1f1b", 128, 72.7),
]


def config(model: str, world: int, batch: int, degrees: dict, mb: int, ac: str, compile_: bool, fp8: bool,
           schedule: str):
    from shardwise.resolve.checks import load_config, resolve_config

    over = [f"--model.name={model}", "--training.seq_len=8192", f"--training.global_batch={batch}",
            f"--training.micro_batch={mb}", f"--activation_checkpoint.mode={ac}",
            f"--compile.enabled={compile_}", f"--float8.enabled={fp8}", f"--parallel.pp_schedule={schedule}",
            "--training.loss=plain",  # torchtitan's: cross-entropy of the fp32 logits, eager
            "--parallel.dp_shard=1", *(f"--parallel.{k}={v}" for k, v in degrees.items())]
    return resolve_config(load_config(None, over), "cuda")  # (auto precision resolves for the GPUs planned)


FIT = {"matmul": (0.30, 0.95), "matmul_fp8": (0.20, 0.95), "attention": (0.15, 0.95), "memory": (0.20, 1.0)}


def fit(hw, estimates: list) -> dict[str, float]:
    """Efficiencies minimising the squared log error of tokens/s over ``estimates`` (label, est,
    published tok/s), re-timing each row's states on the changed profile."""
    import dataclasses
    import math

    from shardwise.plan.cost import step_time

    def loss(eff: dict[str, float]) -> float:
        h = dataclasses.replace(hw, efficiency={**hw.efficiency, **eff})
        total = 0.0
        for _, est, tps in estimates:
            t = step_time(est.run, list(est.states), h)
            total += math.log(t.tokens_per_s / est.run.world / tps) ** 2
        return total

    eff = {k: hw.efficiency.get(k, hw.efficiency["matmul"]) for k in FIT}
    best = loss(eff)
    for _ in range(20):  # coordinate search until no 0.01 step helps
        improved = False
        for k, (lo, hi) in FIT.items():
            for step in (0.01, -0.01):
                while lo <= eff[k] + step <= hi:
                    trial = {**eff, k: round(eff[k] + step, 2)}
                    if (v := loss(trial)) < best - 1e-12:
                        eff, best, improved = trial, v, True
                    else:
                        break
        if not improved:
            break
    return eff


def fit_reserved(estimates: list) -> float:
    """Reserved bytes per live byte minimising the squared log error of memory over ``estimates``
    (label, est, published GiB): the geometric mean of published over live, to 0.01."""
    import math

    from shardwise.plan.estimate import GiB

    logs = [math.log(gib * GiB / est.peak) for _, est, gib in estimates]
    return round(math.exp(sum(logs) / len(logs)), 2)


def main() -> None:
    from shardwise.plan.estimate import GiB, estimate
    from shardwise.plan.hardware import load_hardware
    from shardwise.plan.search import plan

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="h100-gt")
    p.add_argument("--plan", action="store_true")
    p.add_argument("--fit", action="store_true", help="fit the efficiencies on the 8B rows first")
    a = p.parse_args()
    hw = load_hardware(a.hardware)
    if a.fit:
        import dataclasses

        import shardwise.plan.hardware as hardware

        eights = [(label, estimate(config(*row[1:10]), row[2], hw), row[10], row[11]) for row in ROWS
                  for label in [row[0]] if row[1] == "8b"]
        eff = fit(hw, [e[:3] for e in eights])
        ratio = fit_reserved([(e[0], e[1], e[3]) for e in eights])
        print(f"fitted on the {len(eights)} 8B rows: " + ", ".join(f"{k} {v:.2f}" for k, v in eff.items())
              + f"; reserved over live {ratio:.2f}")
        hw = dataclasses.replace(hw, efficiency={**hw.efficiency, **eff})
        hardware.RESERVED_OVER_LIVE = ratio
    print("| run | published tok/s/GPU | predicted | error | published GiB | predicted live peak GiB | "
          "predicted reserved GiB | error | predicted MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    plans = []
    for label, model, world, batch, degrees, mb, ac, comp, fp8, sched, tps, gib in ROWS:
        cfg = config(model, world, batch, degrees, mb, ac, comp, fp8, sched)
        est = estimate(cfg, world, hw)
        print(f"| {label} | {tps:,} | {est.tokens_per_s_per_device:,.0f} | "
              f"{est.tokens_per_s_per_device / tps - 1:+.0%} | {gib} | {est.peak / GiB:.1f} | "
              f"{est.reserved / GiB:.1f} | {est.reserved / GiB / gib - 1:+.0%} | {100 * est.mfu:.1f}% |",
              flush=True)
        plans.append((label, cfg, world, est))
    if not a.plan:
        return
    print("\n| setup | published layout, predicted | plan's best layout | predicted tok/s/GPU | "
          "reserved GiB | gain | plan time |")
    print("|---|---|---|---|---|---|---|")
    seen = set()
    for label, cfg, world, est in plans:
        key = (cfg.model.name, world, cfg.compile.enabled, cfg.float8.enabled)
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        result = plan(cfg, world, hw, top=1)
        dt = time.perf_counter() - t0
        best = result.top[0]
        print(f"| {label} | {est.layout}: {est.tokens_per_s_per_device:,.0f} | {best.layout} | "
              f"{best.tokens_per_s_per_device:,.0f} | {hw.reserved(best.peak) / GiB:.1f} | "
              f"{best.tokens_per_s_per_device / est.tokens_per_s_per_device - 1:+.0%} | {dt:.1f} s |",
              flush=True)


if __name__ == "__main__":
    main()
