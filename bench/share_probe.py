"""The share of the cores a computing rank gets when more gloo processes than cores run at once:
every process computing between barriers (``calibrate``'s share probe, lock-step) against the same
GEMM work alternating with 16 MiB all-gathers (as FSDP's blocks alternate compute and gathers).

    python bench/share_probe.py --world 4 --repeats 3

A share is the work's time alone, stretched to a fair share of the cores (world / cores), over the
time it took: 1.0 is a fair share, more is more than a fair share. Findings: bench/results/history.md
("Where the 125m set's FSDP layouts are over-predicted").
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.plan.calibrate import gather_scatter

ROUNDS, CALLS = 12, 10  # rounds of CALLS GEMMs of (256 x 1024) @ (1024 x 1024)
GATHERED = 4 * 2**20  # fp32 elements gathered per round: 16 MiB


def _work(a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(CALLS):
        torch.mm(a, b)


def _worker(rank: int, world: int, init: str, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    shard, out = torch.randn(GATHERED // world), torch.empty(GATHERED)
    gather, _ = gather_scatter()
    walls = {}
    for mode in ("lockstep", "interleaved", "gathers"):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(ROUNDS):
            if mode != "gathers":
                _work(a, b)
            if mode == "lockstep":
                dist.barrier()
            else:
                gather(out, shard)
        walls[mode] = time.perf_counter() - t0
    if rank == 0:
        queue.put(walls)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    _work(a, b)
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        _work(a, b)
    fair = (time.perf_counter() - t0) * max(1.0, args.world / (os.cpu_count() or 1))
    ctx = mp.get_context("spawn")
    for rep in range(args.repeats):
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            procs = [ctx.Process(target=_worker, args=(r, args.world, f"file://{d}/pg", queue))
                     for r in range(args.world)]
            for proc in procs:
                proc.start()
            w = queue.get()
            for proc in procs:
                proc.join()
        print(f"repeat {rep + 1}: lock-step share {fair / w['lockstep']:.2f}; alternating with gathers "
              f"{fair / (w['interleaved'] - w['gathers']):.2f} (its wall {w['interleaved']:.3f} s less the "
              f"gathers alone {w['gathers']:.3f} s)", flush=True)


if __name__ == "__main__":
    main()
