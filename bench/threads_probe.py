"""A layout's step time under the OpenMP settings a user's environment may bring, and where the
machine's cores go meanwhile (user, system, idle and steal shares from /proc/stat over each run):
``OMP_NUM_THREADS`` unset, asking for more threads than the ranks' share of the cores, and the same
with ``OMP_WAIT_POLICY=passive``.

    python bench/threads_probe.py                  # pp=4 on the debug preset, 4 ranks, 6 steps each
    python bench/threads_probe.py --layout dp_shard=4

Until 4 ranks on 2 cores were given one thread each whatever the environment asked, ``OMP_NUM_THREADS=2``
ran pp=4 7.6x slower, the cores 95% busy in user time (1% idle); ``OMP_WAIT_POLICY=passive`` took it
back to the one-thread speed. Findings: bench/results/history.md ("Pipelines on oversubscribed threads").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_ranking import SETS, measure  # noqa: E402 - the script's own directory first

VARIANTS = {
    "OMP_NUM_THREADS unset": {},
    "OMP_NUM_THREADS=2": {"OMP_NUM_THREADS": "2"},
    "OMP_NUM_THREADS=2, OMP_WAIT_POLICY=passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"},
}


def cpu_times() -> list[int]:
    """Jiffies so far: user (+nice), system (+irq, softirq), idle (+iowait), steal."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return [v[0] + v[1], v[2] + v[5] + v[6], v[3] + v[4], v[7]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="debug", choices=sorted(SETS))
    p.add_argument("--layout", default="pp=4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    a = p.parse_args()
    base, keep = SETS[a.set][0], dict(os.environ)
    print(f"| environment | {a.layout} s/step | run s | user | system | idle | steal |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, env) in enumerate(VARIANTS.items()):
            os.environ.clear()
            os.environ.update({k: v for k, v in keep.items() if not k.startswith("OMP_")} | env)
            before, t0 = cpu_times(), time.perf_counter()
            step = measure(base, a.layout, a.steps, a.warmup, Path(tmp) / str(i))
            wall, d = time.perf_counter() - t0, [y - x for x, y in zip(before, cpu_times(), strict=True)]
            total = sum(d) or 1
            print(f"| {name} | {step:.3f} | {wall:.0f} | " + " | ".join(f"{x / total:.0%}" for x in d) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
