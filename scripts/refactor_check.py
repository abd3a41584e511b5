"""Before and after a refactor: the same losses to the bit, the same planner output to the byte.

    python scripts/refactor_check.py --out before.json            # on the commit before
    python scripts/refactor_check.py --out after.json --compare before.json
    python scripts/refactor_check.py --more ...                    # and TP, CP, PP, MoE TP x EP

Trains the debug preset on 1 rank and on FSDP 4, and moe-debug on EP 2, for 12 steps in fp32 with
``debug.deterministic=true`` (every logged loss, gradient norm, learning rate and validation loss is
kept), and runs ``estimate`` and ``plan`` over the preset configs on GPU hardware profiles (the
output, less the timing line ``plan`` prints). ``--compare`` lists every difference and exits 1 on any.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--training.steps=12", "--training.mixed_precision=fp32", "--debug.deterministic=true",
       "--eval.interval=6", "--checkpoint.interval=0", "--checkpoint.final=false", "--compile.enabled=false",
       "--metrics.tensorboard=false", "--metrics.plot=false", "--metrics.log_format=line",
       "--lr_scheduler.warmup_steps=3"]
RUNS = {"debug-1": ["--config", "configs/debug.toml"],
        "debug-fsdp4": ["--config", "configs/debug.toml", "--nproc", "4", "--parallel.dp_shard", "4"],
        "moe-ep2": ["--config", "configs/moe-debug.toml", "--nproc", "2", "--parallel.ep", "2",
                    "--parallel.dp_shard", "2"]}
MORE_RUNS = {"debug-tp2": ["--config", "configs/debug.toml", "--nproc", "2", "--parallel.tp", "2"],
             "debug-cp2": ["--config", "configs/debug.toml", "--nproc", "2", "--parallel.cp", "2"],
             "debug-pp2": ["--config", "configs/debug.toml", "--nproc", "2", "--parallel.pp", "2"],
             "moe-tp2-ep2": ["--config", "configs/moe-debug.toml", "--nproc", "2", "--parallel.tp", "2",
                             "--parallel.ep", "2"]}
"""``--more``: a run through each other parallelism (tensor, context, pipeline; MoE under TP x EP)."""
KEYS = ("loss", "grad_norm", "lr", "val_loss")
_ESTIMATED = (("debug", 4, "h100"), ("moe-debug", 2, "h100"), ("125m", 8, "h100"), ("1b", 8, "h100"),
              ("8b", 8, "h100"), ("70b", 64, "h100"), ("405b", 512, "h100"), ("qwen3-0.6b", 8, "h200"),
              ("qwen3-30b-a3b", 8, "h100"))
_PLANNED = (("debug", 4, "h100"), ("moe-debug", 4, "h100"), ("125m", 8, "h100"), ("1b", 8, "h200"),
            ("8b", 8, "h100"), ("70b", 256, "h100"), ("405b", 512, "h100"), ("qwen3-0.6b", 8, "h100"),
            ("qwen3-30b-a3b", 8, "h100"))
PLANS = {
    **{f"estimate {m} {n}": ["estimate", "--config", f"configs/{m}.toml", "--nproc", str(n), "--hardware", hw]
       for m, n, hw in _ESTIMATED},
    **{f"plan {m} {n}": ["plan", "--model", m, "--nproc", str(n), "--hardware", hw, "--out", ""]
       for m, n, hw in _PLANNED},
    "estimate debug 4 tp2": ["estimate", "--config", "configs/debug.toml", "--nproc", "4", "--parallel.tp",
                             "2", "--hardware", "h100"],
}


def _shardwise(args: list[str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1800, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if proc.returncode:
        raise SystemExit(f"failed: shardwise {' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def measure(runs: dict[str, list[str]]) -> dict:
    out: dict = {"runs": {}, "plans": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "configs").symlink_to(ROOT / "configs")
        for name, args in runs.items():
            print(f"train {name} ...", flush=True)
            run_dir = work / name
            _shardwise(["train", *args, *RUN, f"--run.dir={run_dir}", f"--data.cache_dir={work / 'cache'}"],
                       work)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out["runs"][name] = [{k: r[k] for k in KEYS if k in r} for r in rows]
        for name, args in PLANS.items():
            print(f"{name} ...", flush=True)
            text = _shardwise(args, work)
            out["plans"][name] = re.sub(r"^\(\d+\.\d s\)$", "", text, flags=re.M)  # plan's own timing
    return out


def compare(after: dict, before: dict) -> list[str]:
    diffs = []
    for kind in ("runs", "plans"):
        for name in sorted(set(before[kind]) | set(after[kind])):
            if before[kind].get(name) != after[kind].get(name):
                diffs.append(f"{kind[:-1]} {name} differs")
    return diffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default="")
    p.add_argument("--more", action="store_true", help="also train " + ", ".join(MORE_RUNS))
    args = p.parse_args()
    result = measure({**RUNS, **(MORE_RUNS if args.more else {})})
    Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.compare:
        return 0
    diffs = compare(result, json.loads(Path(args.compare).read_text()))
    print("\n".join(diffs) if diffs else f"identical: {len(result['runs'])} runs, {len(result['plans'])} "
          "planner outputs")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
