"""Two "nodes" on this machine: two launchers that find each other through c10d rendezvous, as the
torchrun of each node of a cluster does, and form one job; and the Slurm example's command line, run
through a stand-in ``srun`` that starts its per-node command once per node, locally.

What differs on a real cluster (docs/parallelism.md): the rendezvous endpoint is the first node's
address, NCCL carries the collectives, and run.dir and the data sit on a file system every node
reaches -- here the two launchers share this machine's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_ARGS, check_same_run, free_port, metrics, parity_run

pytestmark = pytest.mark.dist


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def _wait(procs: list[subprocess.Popen], timeout: float = 300) -> None:
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-2000:]}\n{err[-4000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    return parity_run(tmp_path_factory.mktemp("ref"), "ref", data_cache)


@pytest.mark.parametrize("layout", [pytest.param(["--parallel.dp_shard=4"], marks=pytest.mark.slow),
                                    ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]],
                         ids=["fsdp_2x2", "hsdp_replicate_across_nodes"])
def test_two_nodes_form_one_job(layout: list[str], reference: Path, tmp_path: Path, data_cache: str):
    """2 nodes x 2 ranks through c10d rendezvous: FSDP over all 4, and HSDP whose replicate dim spans
    the nodes (ranks 0-1 on one node shard, 0 and 2 replicate) -- the same run as one rank."""
    port, run_dir = free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
           "-m", "shardwise", "train", *TINY_ARGS, f"--data.cache_dir={data_cache}",
           f"--run.dir={run_dir}", "--checkpoint.final=true", *layout]
    nodes = [subprocess.Popen([*cmd[:3], f"--node-rank={i}", *cmd[3:]], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    _wait(nodes)
    check_same_run(reference, run_dir, " ".join(layout), ["--nproc=4", *layout])


SRUN = """#!/bin/bash
# A stand-in srun: run the job step's command once per node of the allocation, here, and fail if any
# node fails (as --kill-on-bad-exit would). Its own flags (--kill-on-bad-exit) are dropped.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$STANDIN_LOGS/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""
SCONTROL = """#!/bin/bash
# A stand-in scontrol: every node of the allocation is this machine.
echo 127.0.0.1
"""


def test_the_slurm_example_runs_through_a_standin_srun(reference: Path, tmp_path: Path, data_cache: str):
    """examples/slurm.sbatch as Slurm would run it on 2 nodes of 2 GPUs, with srun and scontrol
    stood in for (per-node commands started here): HSDP with the replicate dim across the nodes, the
    same run as one rank, in runs/<job id>."""
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**_env(), "PATH": path,
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_JOB_NODELIST": "node[1-2]", "RDZV_PORT": str(free_port()), "STANDIN_LOGS": str(logs)}
    config, *overrides = TINY_ARGS[1:]  # (TINY_ARGS starts with --config PATH)
    work = tmp_path / "job"
    work.mkdir()
    proc = subprocess.run(["bash", str(ROOT / "examples" / "slurm.sbatch"), config, *overrides,
                           f"--data.cache_dir={data_cache}", "--checkpoint.final=true",
                           "--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    logs_text = "\n".join(f.read_text()[-3000:] for f in sorted(logs.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{logs_text}"
    run_dir = work / "runs" / "4242"
    assert metrics(run_dir)
    check_same_run(reference, run_dir, "slurm hsdp", ["--nproc=4", "--parallel.dp_replicate=2",
                                                       "--parallel.dp_shard=2"])
