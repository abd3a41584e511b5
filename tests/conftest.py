"""Shared helpers: run the real CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

# A tiny GQA Llama on the shipped corpus: fp32, deterministic, document masking on (so the number
# of valid labels differs between sequences, which is what the global-token normalization handles).
TINY_ARGS = [
    "--config", str(ROOT / "configs" / "debug.toml"),
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.multiple_of=16", "--training.seq_len=64", "--training.global_batch=8",
    "--training.steps=10", "--training.mixed_precision=fp32", "--lr_scheduler.warmup_steps=2",
    "--debug.deterministic=true", "--data.document_mask=true", "--eval.interval=0",
    "--checkpoint.interval=0", "--checkpoint.final=false", "--metrics.tensorboard=false",
    "--metrics.plot=false", "--metrics.log_format=line", "--metrics.peak_tflops=1",
    # Eager even when a test runs 100,000 steps to be stopped by a signal (compile.enabled=auto
    # would compile those): compile has its own tests, which pass --compile.enabled=true.
    "--compile.enabled=false",
]


# .ci/run sets this: there a missing test tool (transformers, wandb, chromium, unshare) is a failure;
# elsewhere the test that needs it is skipped with its reason shown (pytest -rs).
IN_CI = os.environ.get("SHARDWISE_CI") == "1"


def need(what: str, present: bool) -> None:
    """Fail under CI, skip visibly elsewhere, when ``what`` (a tool a test needs) is not ``present``."""
    if present:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing: .ci/run must install it")
    pytest.skip(f"{what} is not available on this machine")


def require(module: str):  # noqa: ANN201 - the module
    """Import a test dependency, under :func:`need`'s rule."""
    import importlib
    import importlib.util

    need(f"python package {module}", importlib.util.find_spec(module) is not None)
    return importlib.import_module(module)


def run_cli(args: list[str], timeout: float = 300, launcher: list[str] | None = None,
            check: bool = True, fault: str = "") -> subprocess.CompletedProcess:
    """``python -m shardwise <args>`` (or under ``launcher``, e.g. torchrun), from the repo root.
    ``fault``: break one thing on purpose in every process of the run (tests/faults/sitecustomize.py)."""
    cmd = [sys.executable, *(launcher or ["-m", "shardwise"]), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    if fault:
        env["SHARDWISE_TEST_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "faults"),
                                                          env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One token cache for the whole session: the corpus is tokenized once."""
    return str(tmp_path_factory.mktemp("cache"))


@contextlib.contextmanager
def one_rank_pg() -> Iterator[None]:
    """A one-rank gloo process group for the block (the one already there, if any)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group (FSDP and DCP need one), for the whole module."""
    with one_rank_pg():
        yield
