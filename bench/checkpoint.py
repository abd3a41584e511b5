"""Checkpoint save and load time of the 125m preset: sync vs async (thread, process).

The model is the real one (FSDP2 on a one-rank gloo mesh, fp32 parameters, AdamW states filled by
one optimizer step), saved by the trainer's own :class:`~shardwise.checkpoint.Checkpointer`. For
each mode the table gives how long ``save()`` blocks training and how long until the checkpoint
is committed (manifest written, directory renamed); then the load time with and without the
SHA-256 verification. Every mode is repeated and the median reported.

    python bench/checkpoint.py                 # 125m, 3 repeats, into a temporary directory
    python bench/checkpoint.py --dir /nvme/tmp # where the files go matters most
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


class Position:
    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "position": 0, "num_sequences": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="125m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    a = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardwise import checkpoint
    from shardwise.config.schema import CheckpointConfig
    from shardwise.models import PRESETS
    from shardwise.models.transformer import build_model, init_weights

    root = Path(tempfile.mkdtemp(dir=a.dir))
    dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = build_model(PRESETS[a.model])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for prm in model.parameters():
        prm.grad = torch.zeros_like(prm)
    opt.step()  # materialize exp_avg / exp_avg_sq
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    n_params = sum(prm.numel() for prm in model.parameters())
    rows = []
    for mode in ("none", "thread", "process"):
        blocked, total = [], []
        ck = checkpoint.Checkpointer(root / mode, CheckpointConfig(async_mode=mode, keep_latest_k=1), {})
        for r in range(a.repeats + 1):  # the first save warms up (the process mode starts its worker)
            t0 = time.perf_counter()
            ck.save(r, model, opt, sched, Position())
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            if r:
                blocked.append(t1 - t0)
                total.append(t2 - t0)
        ck.close()
        rows.append((mode, statistics.median(blocked), statistics.median(total)))
    path = checkpoint.list_checkpoints(root / "none")[-1][1]
    size = sum(f.stat().st_size for f in path.iterdir())
    loads = {}
    for verify in (True, False):
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            checkpoint.load(path, model, opt, sched, Position(), checksums=verify)
            times.append(time.perf_counter() - t0)
        loads[verify] = statistics.median(times)
    print(f"{a.model}: {n_params / 1e6:.1f}M params, checkpoint {size / 2**30:.2f} GiB (fp32 params + AdamW "
          f"states), 1 rank, median of {a.repeats}, {os.cpu_count()} CPU cores\n")
    print("| save mode | training blocked (s) | until committed (s) | blocked vs sync |")
    print("|---|---|---|---|")
    sync = rows[0][1]
    for mode, b, t in rows:
        print(f"| {mode} | {b:.2f} | {t:.2f} | {b / sync:.2f}x |")
    print("\n| load | time (s) |\n|---|---|")
    print(f"| with SHA-256 verification | {loads[True]:.2f} |\n| sizes only | {loads[False]:.2f} |")
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
