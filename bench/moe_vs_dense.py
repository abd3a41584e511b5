"""The MoE presets against the dense preset of the same active size, trained the same way: loss,
held-out loss and every MoE block's expert load, step by step, from one ``shardwise train`` run each.

    python bench/moe_vs_dense.py --steps 300                  # debug, moe-debug, deepseek-debug
    python bench/moe_vs_dense.py --steps 300 --configs configs/moe-debug.toml -- --model.moe_aux_coef 0.03

Each config trains with its own defaults but ``--training.steps`` (and a held-out evaluation every
``--eval-interval`` steps over ``--eval-steps`` batches, the same for all); the extra overrides after
``--`` go to every run. ``debug`` (dense: a 768-wide SwiGLU) and ``moe-debug`` (two 256-wide routed
experts of eight and a 256-wide shared one) have the same active parameters per token;
``deepseek-debug`` has 6.18M to their 6.17M. Writes ``--out``.json (the curves) and ``--out``.png
(loss, held-out loss, and each MoE run's worst-block load), and prints a table: the last ten steps'
mean loss, the last held-out loss, and the worst block's load from step 20 (its maximum, its mean,
and how many steps were above 1.5x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["configs/debug.toml", "configs/moe-debug.toml", "configs/deepseek-debug.toml"]


def train(config: str, steps: int, every: int, batches: int, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", config, f"--training.steps={steps}",
           f"--eval.interval={every}", f"--eval.steps={batches}", "--checkpoint.interval=0",
           "--checkpoint.final=false", "--metrics.plot=false", "--metrics.tensorboard=false",
           f"--run.dir={run_dir}", "--run.overwrite=true", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    loss = [r["loss"] for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    late = [r["expert_load"] for r in rows if "expert_load" in r and r["step"] >= 20]
    out = {"loss_last10": sum(loss[-10:]) / len(loss[-10:]), "val_loss": val[-1][1] if val else None,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)}
    if late:
        out.update(load_max=max(late), load_mean=sum(late) / len(late),
                   steps_above_1_5=sum(x > 1.5 for x in late))
    return out


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_load) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows if "loss" in r]
        line, = ax_loss.plot(steps, [r["loss"] for r in rows if "loss" in r], lw=0.8, alpha=0.7, label=name)
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax_loss.plot(*zip(*val, strict=True), "o-", color=line.get_color(), label=f"{name} held-out")
        load = [(r["step"], r["expert_load"]) for r in rows if "expert_load" in r]
        if load:
            ax_load.plot(*zip(*load, strict=True), lw=0.9, color=line.get_color(), label=name)
    ax_loss.set(xlabel="step", ylabel="loss", ylim=(None, 6.0), title="loss (line) and held-out loss (dots)")
    ax_load.axhline(1.5, color="grey", ls="--", lw=0.8)
    ax_load.set(xlabel="step", ylabel="worst block's expert load (busiest / mean)", title="expert load")
    ax_loss.legend(fontsize=8)
    ax_load.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-steps", type=int, default=8)
    ap.add_argument("--runs", default="runs/moe_vs_dense", help="the runs' parent folder")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.png")
    ap.add_argument("--reuse", action="store_true", help="read a config's finished run from --runs instead "
                    "of training it again (one that reached --steps)")
    ap.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    a = ap.parse_args()
    curves = {}
    for config in a.configs:
        name = Path(config).stem
        run_dir = ROOT / a.runs / name
        done = run_dir / "metrics.jsonl"
        reuse = a.reuse and done.exists()
        rows = [json.loads(line) for line in done.read_text().splitlines()] if reuse else []
        if not any(r.get("step") == a.steps and "loss" in r for r in rows):
            rows = train(config, a.steps, a.eval_interval, a.eval_steps, run_dir, a.extra)
        curves[name] = rows
    print("| config | loss, last 10 steps | held-out loss | tokens/s | worst block's load from step 20: "
          "max / mean / steps > 1.5 |")
    print("|---|---|---|---|---|")
    for name, rows in curves.items():
        s = summary(rows)
        moe = any("expert_load" in r for r in rows)
        load = (f"{s['load_max']:.2f} / {s['load_mean']:.2f} / {s['steps_above_1_5']}" if "load_max" in s
                else "(no step from 20)" if moe else "(dense)")
        val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "-"
        print(f"| {name} | {s['loss_last10']:.4f} | {val} | {s['tokens_per_s']:,.0f} | {load} |")
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({n: [{k: v for k, v in r.items() if k in (
            "step", "loss", "val_loss", "expert_load", "expert_load_layers")} for r in rows]
            for n, rows in curves.items()}))
        plot(curves, Path(a.out + ".png"))


if __name__ == "__main__":
    main()
