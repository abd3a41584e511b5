"""A rank's way out: leaving the process groups before the interpreter finalizes.

Without :func:`shardwise.runtime.distributed.leave_distributed`, a rank that exits right after a
collective can abort in interpreter finalization (a gloo worker thread still freeing the collective's
tensors needs the GIL): "terminate called without an active exception" beside the rank's one-line error.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# Two ranks gather an object (as the checkpoint check does), then exit at once with code 2, as a
# rank does after a one-line error; LEAVE says whether they leave their groups first.
_RANK = """
import sys, torch.distributed as dist
from shardwise.runtime.distributed import leave_distributed
rank, store, leave = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
dist.new_group(backend="gloo")
found = [None, None]
dist.all_gather_object(found, {"rank": rank, "problem": "x" * 100})
if leave:
    leave_distributed()
sys.exit(2)
"""

# Rank 0 starts a collective that rank 1 never joins (rank 1 stays alive elsewhere), then leaves.
_STUCK = """
import sys, time, torch, torch.distributed as dist
from shardwise.runtime.distributed import leave_distributed
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
dist.barrier()
if rank == 1:
    time.sleep(60)
    sys.exit(0)
dist.all_reduce(torch.ones(4), async_op=True)
t = time.perf_counter()
leave_distributed(timeout_s=1.0)
print(f"left after {time.perf_counter() - t:.2f} s", flush=True)
"""


def _two_ranks(script: str, tmp: Path, *extra: str) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of the script run as ranks 0 and 1."""
    store = tmp / "store"
    store.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(store), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=60) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def test_ranks_that_leave_their_groups_exit_with_their_own_code(tmp_path: Path):
    """12 runs of two ranks that exit right after a gather: every rank exits 2 with an empty stderr.
    Without leaving the groups a run aborted in 7 of 40 here (17%; in 4 of 10 under load), so 12
    clean runs would happen by chance with probability 0.83^12, about 11%."""
    for trial in range(12):
        for code, _, err in _two_ranks(_RANK, tmp_path, "1"):
            assert code == 2 and err.strip() == "", (trial, code, err[-2000:])


def test_leaving_does_not_wait_for_a_collective_no_peer_joins(tmp_path: Path):
    """A collective that the peer never joins would hold the destroy until that peer exits (here a
    minute): leaving gives up after its timeout, so a failed rank still exits promptly."""
    start = time.perf_counter()
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", _STUCK, str(r), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=45)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 0, err[-2000:]
    left = float(out.split("left after ")[1].split()[0])
    assert left < 5, out
    assert time.perf_counter() - start < 45
