"""Does FSDP's communication hide behind compute when more gloo processes than cores run at once?
Every process runs FSDP2's pattern over ``--blocks`` blocks -- a gather prefetched one block ahead
(asynchronous) and GEMM work per block, then GEMM work and an asynchronous reduce-scatter per block,
all waited at the end -- against the same compute alone, the collectives alone, and both in
lock-step. "exposed" is the step less the compute alone, over the collectives alone: 1 adds them up,
0 hides them. Also the cores the collectives alone keep busy (user + system CPU time of all
processes over the wall time: gloo's loopback TCP is mostly kernel time).

    python bench/fsdp_overlap.py --mib 64 --calls 45   # the 125m set's proportions on 4 ranks
    python bench/fsdp_overlap.py --mib 2 --calls 18    # the debug set's

Findings: bench/results/history.md ("FSDP's copies and unequal pipeline stages").
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.plan.calibrate import gather_scatter

MODES = ("compute", "comm", "lockstep", "fsdp")


def _step(mode: str, blocks: int, calls: int, bufs: dict) -> None:
    a, b, full, shard, grad, gshards = (bufs[k] for k in ("a", "b", "full", "shard", "grad", "gshards"))
    gather, scatter = gather_scatter()

    def work() -> None:
        for _ in range(calls):
            torch.mm(a, b)
    if mode == "compute":
        for _ in range(2 * blocks):
            work()
    elif mode == "comm":
        for i in range(blocks):
            gather(full[i], shard)
        for i in range(blocks):
            scatter(gshards[i], grad)
    elif mode == "lockstep":
        for i in range(blocks):
            gather(full[i], shard)
            work()
        for i in range(blocks):
            work()
            scatter(gshards[i], grad)
    else:  # as FSDP2 runs: the next block's gather in flight while this one computes
        handle = gather(full[0], shard, async_op=True)
        for i in range(blocks):
            handle.wait()
            if i + 1 < blocks:
                handle = gather(full[i + 1], shard, async_op=True)
            work()
        pending = []
        for i in range(blocks):
            work()
            pending.append(scatter(gshards[i], grad, async_op=True))
        for h in pending:
            h.wait()


def _worker(rank: int, world: int, init: str, queue: mp.Queue, mib: int, calls: int, blocks: int,
            repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    n = mib * 2**20 // 4  # fp32 elements per block's gathered buffer
    bufs = {"a": torch.randn(256, 1024), "b": torch.randn(1024, 1024),
            "full": [torch.empty(n) for _ in range(blocks)], "shard": torch.randn(n // world),
            "grad": torch.randn(n), "gshards": [torch.empty(n // world) for _ in range(blocks)]}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpu = []
    for _ in range(repeats):
        for mode in MODES:
            dist.barrier()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            _step(mode, blocks, calls, bufs)
            dist.barrier()
            walls[mode].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if mode == "comm":
                cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    busy = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
    dist.all_reduce(busy)  # CPU seconds of all processes
    if rank == 0:
        queue.put(({m: statistics.median(v) for m, v in walls.items()}, busy.item()))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mib", type=int, default=16, help="each block's gathered buffer, MiB of fp32")
    p.add_argument("--calls", type=int, default=18,
                   help="GEMMs of (256 x 1024) @ (1024 x 1024) per block and pass")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, a.world, f"file://{d}/pg", queue, a.mib, a.calls,
                                                   a.blocks, a.repeats)) for r in range(a.world)]
        for proc in procs:
            proc.start()
        w, busy = queue.get()
        for proc in procs:
            proc.join()
    comp, comm = w["compute"], w["comm"]
    print(f"{a.world} processes on {os.cpu_count()} cores, {a.blocks} blocks of {a.mib} MiB, {a.calls} GEMMs "
          f"per block and pass: compute alone {comp:.3f} s, collectives alone {comm:.3f} s (keeping "
          f"{busy / comm:.2f} cores busy); lock-step {w['lockstep']:.3f} s (exposed "
          f"{(w['lockstep'] - comp) / comm:.2f}); FSDP's pattern {w['fsdp']:.3f} s (exposed "
          f"{(w['fsdp'] - comp) / comm:.2f})")


if __name__ == "__main__":
    main()
