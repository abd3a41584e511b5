"""The planner against measurement on this machine: for each layout, a real ``shardwise train`` run
on N gloo ranks next to ``shardwise estimate`` of the same config.

Measured, per run (the trainer's own instruments):

- parameters / gradients / optimizer states per rank, counted from the tensors at the first step
  (``memory_breakdown.json``);
- every collective of step ``--trace-step`` with its buffer bytes (``--debug.comm``, rank 0);
- the live-tensor peak of that step per rank (``--debug.memory``: torch's MemTracker);
- the step time: median of the logged steps after the traced one.

Predicted: ``shardwise.plan.estimate`` on ``--hardware`` (``local`` after ``shardwise calibrate``),
with states from the real model on the fake process group. An expert-parallel layout is estimated
twice: with balanced routing (``parallel.expert_load`` 1, the default) and with the run's own
routing (its median logged ``expert_load`` over the timed steps), the step column showing both.

    python bench/plan_accuracy.py --calibrate           # calibrate, then the default layouts
    python bench/plan_accuracy.py --layouts debug:tp=2 125m:dp_shard=2 --steps 8
    python bench/plan_accuracy.py --steps 20 --trace-step 12 --layouts \
        moe-debug:dp_shard=4,ep=4,model.moe_balance=none     # routing left to collapse: load ~4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# preset:layout[,key=value...]; the presets run in fp32 (see BENCHMARKS.md for why).
DEFAULT = [
    "debug:dp_shard=1", "debug:dp_shard=2", "debug:dp_shard=4", "debug:tp=2", "debug:dp_shard=2,tp=2",
    "debug:cp=2", "debug:pp=2,training.micro_batch=2", "debug:dp_replicate=2,dp_shard=2",
    "debug:dp_shard=2,activation_checkpoint.mode=full", "debug:dp_shard=8",
    "moe-debug:dp_shard=2,ep=2", "125m:dp_shard=1", "125m:dp_shard=2", "125m:tp=2",
]
PRESET_ARGS = {
    "debug": ["--config", "configs/debug.toml"],
    "moe-debug": ["--config", "configs/moe-debug.toml"],
    "125m": ["--config", "configs/debug.toml", "--model.name=125m", "--training.global_batch=4",
             "--training.seq_len=256"],
}
COMMON = ["--training.mixed_precision=fp32", "--lr_scheduler.warmup_steps=1", "--eval.interval=0",
          "--checkpoint.interval=0", "--checkpoint.final=false", "--metrics.log_format=line",
          "--metrics.tensorboard=false", "--metrics.plot=false", "--metrics.peak_tflops=1",
          "--debug.comm=true", "--debug.memory=true", "--run.overwrite=true"]


def measure(preset: str, layout: str, steps: int, trace: int, run_dir: Path) -> tuple[list[str], int, dict]:
    from shardwise.resolve.layouts import parse_layout

    overrides, world = parse_layout(layout)
    args = [*PRESET_ARGS[preset], *overrides, *COMMON, f"--training.steps={steps}",
            f"--debug.trace_step={trace}", f"--run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "shardwise", "train", *args] + ([f"--nproc={world}"] if world > 1 else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{preset}:{layout} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return args, world, {
        "states": json.loads((run_dir / "memory_breakdown.json").read_text()),
        "comm": json.loads((run_dir / "comm.json").read_text())["totals"],
        "peak": json.loads((run_dir / "memory_peak.json").read_text())["total_per_rank"],
        "step_s": statistics.median(r["step_time_s"] for r in rows if r["step"] > trace),
        "load": statistics.median(r.get("expert_load", 1.0) for r in rows if r["step"] > trace),
    }


def by_ranks(degrees, totals: dict[str, dict[str, int]], alias: dict[str, str]) -> dict:
    """Comm totals keyed by (rank set, collective): mesh dims that are the same group merge."""
    from shardwise.plan.comm import group_members

    out: dict = {}
    for group, per in totals.items():
        key = tuple(sorted(group_members(degrees, alias.get(group, group))))
        for kind, b in per.items():
            out[(key, kind)] = out.get((key, kind), 0) + b
    return out


def compare(args: list[str], world: int, meas: dict, hardware: str) -> dict:
    from shardwise.plan.comm import totals
    from shardwise.plan.estimate import estimate
    from shardwise.plan.hardware import load_hardware
    from shardwise.resolve.checks import load_config

    overrides = [a for a in args[2:] if a.startswith("--") and "run.dir" not in a]
    cfg = load_config(args[1], overrides)
    hw = load_hardware(hardware, cfg.data.cache_dir)
    est = estimate(cfg, world, hw)
    loaded = None  # the step under the run's own routing (expert parallel only)
    if est.layout.ep > 1 and meas["load"] > 1.0:
        loaded = estimate(load_config(args[1], [*overrides, f"--parallel.expert_load={meas['load']:.3f}"]),
                          world, hw).time.step
    lay, per_stage = est.layout, world // est.layout.pp
    GiB = 2**30
    states_exact = all(
        round(meas["states"][f"{k}_per_rank"][r] * GiB) == getattr(est.states[r // per_stage], k)
        for r in range(world) for k in ("params", "grads", "optimizer"))
    measured_comm = by_ranks(lay.degrees, meas["comm"], {"experts": "efsdp"})
    predicted_comm = by_ranks(lay.degrees, totals(list(est.collectives[0])), {})
    comm_ratio = sum(predicted_comm.values()) / max(1, sum(measured_comm.values()))
    peaks = [(est.memory[r // per_stage].peak, meas["peak"][r] * GiB) for r in range(world)]
    pred_peak, meas_peak = max(peaks, key=lambda x: x[1])
    return {"layout": str(lay), "world": world, "states_exact": states_exact,
            "comm_exact": measured_comm == predicted_comm, "comm_ratio": comm_ratio,
            "comm_mib": sum(measured_comm.values()) / 2**20,
            "peak_pred": pred_peak / 2**20, "peak_meas": meas_peak / 2**20,
            "step_pred": est.time.step, "step_meas": meas["step_s"], "load": meas["load"],
            "step_pred_loaded": loaded}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=DEFAULT, help="preset:layout items")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--trace-step", type=int, default=2)
    p.add_argument("--hardware", default="local")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--calibrate", action="store_true",
                   help="run `shardwise calibrate` first: a shared or throttled machine's speed drifts "
                        "by tens of percent over hours, so the profile should be as fresh as the runs")
    a = p.parse_args()
    if a.calibrate:
        subprocess.run([sys.executable, "-m", "shardwise", "calibrate"], cwd=ROOT, check=True)
    print("| preset | layout | ranks | states | comm MiB/step (pred/meas) | peak MiB pred / meas (err) | "
          "step s pred / meas (err) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, item in enumerate(a.layouts):
            preset, _, layout = item.partition(":")
            args, world, meas = measure(preset, layout, a.steps, a.trace_step, Path(tmp) / str(i))
            r = compare(args, world, meas, a.hardware)
            r["preset"] = preset
            rows.append(r)
            comm = "exact" if r["comm_exact"] else f"{r['comm_ratio']:.3f}x"
            loaded = ("" if r["step_pred_loaded"] is None else f"; at load {r['load']:.2f}: "
                      f"{r['step_pred_loaded']:.2f} ({r['step_pred_loaded'] / r['step_meas'] - 1:+.0%})")
            print(f"| {preset} | {r['layout']} | {world} | {'exact' if r['states_exact'] else 'DIFF'} | "
                  f"{r['comm_mib']:.1f} ({comm}) | {r['peak_pred']:.1f} / {r['peak_meas']:.1f} "
                  f"({r['peak_pred'] / r['peak_meas'] - 1:+.1%}) | {r['step_pred']:.2f} / "
                  f"{r['step_meas']:.2f} ({r['step_pred'] / r['step_meas'] - 1:+.0%}){loaded} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
