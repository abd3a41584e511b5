"""Stopping and failing well, through the real CLI: SIGTERM, kill -9 during saves, a rank killed
under --max-restarts, NaN policy, disk full on save."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint
from shardwise.models import model_args
from shardwise.models.transformer import build_model
from shardwise.resolve.checks import load_config
from shardwise.verify.parity import checkpoint_params
from tests.helpers import ROOT, TINY_ARGS, metrics, need, run_cli


def start(args: list[str], new_session: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, "-m", "shardwise", "train", *TINY_ARGS, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


def wait_for(cond, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} early:\n{out[-2000:]}\n{err[-3000:]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.05)


def logged_steps(run_dir: Path) -> int:
    log = run_dir / "metrics.jsonl"
    return len(log.read_text().splitlines()) if log.is_file() else 0


def loadable(path: Path) -> None:
    """Full check of a checkpoint from outside any job: manifest, checksums, shapes, then a load."""
    manifest = checkpoint.verify(path)
    cfg = load_config(None, [f"--model.{k}={v}" for k, v in manifest["model"].items()])
    model = build_model(model_args(cfg.model))
    checkpoint.check_compatible(path, model)
    model.to_empty(device="cpu")
    checkpoint.load_model_only(path, model)


@pytest.mark.parametrize(("nproc", "group"), [pytest.param(1, False, id="1"),
                                             pytest.param(2, False, id="2", marks=pytest.mark.slow),
                                             pytest.param(2, True, id="2-group")])
def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path: Path, data_cache: str, nproc: int,
                                                     group: bool):
    """SIGTERM to the launcher; ``group``: to its whole process group, as a terminal's Ctrl-C or
    ``kill -TERM -<group>`` sends it (the rank server is in that group and must outlive the signal:
    the ranks, which watch it, would otherwise stop without saving)."""
    run_dir = tmp_path / "r"
    common = [f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}", "--checkpoint.final=true",
              *([f"--nproc={nproc}"] if nproc > 1 else [])]
    proc = start([*common, "--training.steps=100000"], new_session=group)
    wait_for(lambda: logged_steps(run_dir) >= 3, proc)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "received SIGTERM: stopped after step" in out
    last = metrics(run_dir)[-1]["step"]
    found = checkpoint.list_checkpoints(run_dir / "checkpoints")
    assert [s for s, _ in found] == [last]
    checkpoint.verify(found[-1][1])
    run_cli(["train", *TINY_ARGS, *common, "--checkpoint.resume=true", f"--training.steps={last + 2}"])
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, last + 3))


def in_flight(folder: Path) -> bool:
    """A save being staged or a retired checkpoint being deleted in ``folder``."""
    return any(name.endswith((".tmp", ".deleting")) for name in os.listdir(folder))


def kill_mid_save(proc: subprocess.Popen, folder: Path, timeout: float = 120) -> None:
    """SIGKILL ``proc`` the moment a save or a deletion is under way (polled every millisecond)."""
    end = time.monotonic() + timeout
    while not in_flight(folder):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"no save under way in {folder} (exit {proc.poll()})")
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)


@pytest.mark.parametrize("rounds", [pytest.param(10, marks=pytest.mark.slow), 2])
def test_kill_9_never_leaves_an_unloadable_latest_checkpoint(tmp_path: Path, data_cache: str, rounds: int):
    """2 x ``rounds`` runs killed with SIGKILL while saving every step (two lanes, sync and
    async saves); each next run resumes the same run dir from what the kill left. Every other round
    kills at a random moment, the rest the moment a save is staged: those must land mid-save (a
    staging or deleting directory left behind; a kill that missed is retried, at most 3 times).
    The 20-kill version is in the extended set (make test-all); CI runs 4 kills."""
    rng = random.Random(rounds)
    lanes = {mode: tmp_path / mode for mode in ("none", "thread")}
    torn = {mode: 0 for mode in lanes}  # kills that landed mid-save

    def kill_once(mode: str, mid_save: bool) -> bool:
        folder = lanes[mode] / "checkpoints"
        before = {s for s, _ in checkpoint.list_checkpoints(folder)}
        proc = start([f"--data.cache_dir={data_cache}", f"--run.dir={lanes[mode]}",
                      "--training.steps=100000", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2",
                      f"--checkpoint.async_mode={mode}", "--checkpoint.resume=true"])
        wait_for(lambda: {s for s, _ in checkpoint.list_checkpoints(folder)} - before, proc)
        if mid_save:
            kill_mid_save(proc, folder)
        else:
            time.sleep(rng.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
        proc.communicate()
        left = in_flight(folder)
        found = checkpoint.list_checkpoints(folder)
        assert found, f"{mode}: no committed checkpoint"
        loadable(found[-1][1])
        return left

    for trial in range(rounds):
        for mode in lanes:
            mid_save = trial % 2 == 1
            for _attempt in range(3 if mid_save else 1):
                hit = kill_once(mode, mid_save)
                torn[mode] += hit
                if hit or not mid_save:
                    break
            assert hit or not mid_save, f"{mode}: three kills aimed mid-save all missed"
    assert all(n >= rounds // 2 for n in torn.values()), torn


def test_rank_killed_mid_run_restarts_and_matches_the_uninterrupted_run(tmp_path: Path, data_cache: str):
    common = ["--nproc=2", f"--data.cache_dir={data_cache}", "--checkpoint.interval=3",
              "--checkpoint.final=true"]
    full = tmp_path / "full"
    run_cli(["train", *TINY_ARGS, *common, f"--run.dir={full}"])
    hit = tmp_path / "hit"
    proc = run_cli(["train", *TINY_ARGS, *common, f"--run.dir={hit}", "--max-restarts=1",
                    "--debug.fail_step=5", "--debug.fail_rank=1"])
    assert "resumed from" in proc.stdout and "step-3 at step 3" in proc.stdout
    want, got = metrics(full), metrics(hit)
    assert [r["step"] for r in got] == list(range(1, 11))  # steps 4-5 re-run once, nothing lost
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    a, b = (checkpoint_params(d / "checkpoints" / "step-10") for d in (full, hit))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_skip_drops_the_update(tmp_path: Path, data_cache: str):
    run_dir = tmp_path / "skip"
    proc = run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
                    "--debug.nan_step=3", "--training.nonfinite=skip", "--checkpoint.interval=1",
                    "--training.steps=4"])
    assert "step 3: non-finite gradient norm, update skipped (1 so far)" in proc.stdout
    rows = metrics(run_dir)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1]
    assert rows[2]["loss"] != rows[2]["loss"] and rows[3]["loss"] == rows[3]["loss"]  # NaN, then fine
    p2, p3, p4 = (checkpoint_params(run_dir / "checkpoints" / f"step-{s}") for s in (2, 3, 4))
    assert all(torch.equal(p2[k], p3[k]) for k in p2)  # step 3 changed nothing
    assert any(not torch.equal(p3[k], p4[k]) for k in p3)


def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path: Path, data_cache: str):
    run_dir = tmp_path / "stop"
    proc = run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
                    "--debug.nan_step=5", "--checkpoint.interval=2", "--checkpoint.final=true"], check=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "step 5: non-finite gradient norm nan" in lines[0], lines
    assert "step-4 holds the last good state" in lines[0]
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir / "checkpoints")] == [2, 4]
    checkpoint.verify(run_dir / "checkpoints" / "step-4")


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def test_disk_full_on_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path, data_cache: str):
    """run.dir on a 6 MiB tmpfs: the first checkpoint (~3.6 MiB) fits, the second cannot."""
    need("unshare with user namespaces (a private tmpfs mount makes the full disk)", _can_mount_tmpfs())
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={disk}/r",
            "--checkpoint.interval=2"]
    # The test copies the checkpoint out before the mount (private to the child) disappears.
    script = (f"mount -t tmpfs -o size=6m tmpfs {disk} && {sys.executable} -m shardwise "
              + " ".join(f"'{a}'" for a in args) + f"; rc=$?; cp -r {disk}/r {tmp_path}/copy; exit $rc")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "could not save checkpoint step-4" in lines[0] and "No space left on device" in lines[0]
    assert "the last checkpoint step-2 is intact" in lines[0]
    copy = tmp_path / "copy" / "checkpoints"
    assert [s for s, _ in checkpoint.list_checkpoints(copy)] == [2]
    assert not list(copy.glob("*.tmp"))  # the failed save cleaned up after itself
    loadable(copy / "step-2")
    json.loads((copy / "step-2" / checkpoint.MANIFEST).read_text())


# --------------------------------------------------------------------------------------------------
# The fault suite of what a user's checkpoint and run directory meet (issue #59): each damage to each
# kind of checkpoint file, met by each command that reads a checkpoint, ends in one line naming the
# file, exit 2, and nothing changed; foreign files beside a run are neither loaded nor lost; a full
# disk during an export stops with one line and keeps the checkpoint.

FILE_KINDS = {"distcp": "*.distcp", "metadata": ".metadata", "rng": "rng-rank0.pt",
              "manifest": "manifest.json"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    run_dir = tmp_path_factory.mktemp("suite") / "run"
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
             "--training.steps=2", "--checkpoint.final=true"])
    return run_dir


def _damage(ckpt: Path, kind: str, how: str) -> str:
    """Damage one file of ``kind`` in ``ckpt`` (a byte flipped in place, or its tail cut); its name."""
    f = next(ckpt.glob(FILE_KINDS[kind]))
    data = bytearray(f.read_bytes())
    if how == "flip":
        data[len(data) // 3] ^= 0x55
    else:
        del data[len(data) * 2 // 3:]
    f.write_bytes(bytes(data))
    return f.name


# make test: every reader meets a damaged .distcp, and generate every kind of file; the other 18 of
# the 32 combinations run in make test-all.
SUITE = [pytest.param(c, k, h, marks=[] if k == "distcp" or c == "generate" else [pytest.mark.slow],
                      id=f"{c}-{k}-{h}")
         for c in ("train", "eval", "generate", "convert") for k in FILE_KINDS for h in ("flip", "truncate")]


@pytest.mark.parametrize("command,kind,how", SUITE)
def test_every_damaged_checkpoint_file_is_one_line_for_every_reader(command: str, kind: str, how: str,
                                                                     saved: Path, tmp_path: Path,
                                                                     data_cache: str):
    ckpt = tmp_path / "step-2"
    shutil.copytree(saved / "checkpoints" / "step-2", ckpt)
    shutil.copy(saved / "config.toml", tmp_path / "config.toml")
    name = _damage(ckpt, kind, how)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    args = {"train": ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path / 'r'}",
                      f"--checkpoint.path={ckpt}", "--training.steps=3"],
            "eval": ["eval", "--checkpoint", str(ckpt), f"--data.cache_dir={data_cache}"],
            "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "And", "--max-new-tokens", "2"],
            "convert": ["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]}[command]
    proc = run_cli(args, check=False, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines()
             if ln.strip() and not ln.startswith(("warning:", "notice:"))]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("shardwise: error:") and str(ckpt) in lines[0], lines
    if kind == "manifest":
        assert "manifest.json" in lines[0], lines  # unreadable, or naming what it no longer matches
    else:
        assert name in lines[0] and ("SHA-256" in lines[0] or "truncated" in lines[0]), lines
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert not (tmp_path / "hf").exists()
    assert not (tmp_path / "r" / "metrics.jsonl").exists() or not metrics(tmp_path / "r")


def test_foreign_files_in_a_run_directory_are_neither_loaded_nor_lost(saved: Path, tmp_path: Path,
                                                                      data_cache: str):
    """A user's files in checkpoints/ (a file named like a checkpoint, a notes.tmp, a folder without a
    manifest) and beside it: resume loads step-2, and each foreign file is still there, unchanged. (Only
    step-<N>.tmp and step-<N>.deleting folders, what an interrupted save or deletion leaves, are
    cleared by the next save.)"""
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    foreign = {"checkpoints/step-9": "a file, not a checkpoint", "checkpoints/notes.tmp": "mine",
               "checkpoints/step-7/weights.bin": "no manifest", "checkpoints/notes.tmp.d/keep": "mine too",
               "hf/my-llama/config.json": "{}", "config.base.toml": "[training]"}
    for rel, text in foreign.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    proc = run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
                    "--checkpoint.resume=true", "--training.steps=3", "--checkpoint.final=true"])
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout, proc.stdout[-2000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    for rel, text in foreign.items():
        assert (run_dir / rel).read_text() == text, rel
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir / "checkpoints")] == [2, 3]


def test_a_full_disk_during_an_export_is_one_line_and_keeps_the_checkpoint(tmp_path: Path, data_cache: str):
    run_dir = tmp_path / "run"
    proc = run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
                    "--training.steps=2", "--checkpoint.interval=2", "--checkpoint.export_hf=true"],
                   check=False, fault="enospc_export")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "could not export step-2 as a Hugging Face folder" in lines[0] and "No space left" in lines[0]
    assert "is saved and intact" in lines[0]
    loadable(run_dir / "checkpoints" / "step-2")
    assert list((run_dir / "hf").iterdir()) == []  # nothing half-written (no staging folder either)


# The debug preset's own shape (it learns enough in six steps for random tokens to stand out).
SPIKE = ["--model.dim=256", "--model.n_layers=6", "--model.n_heads=16", "--model.n_kv_heads=16",
         "--model.multiple_of=256", "--training.steps=8", "--training.spike_window=3",
         "--training.spike_factor=1.2", "--debug.spike_step=7", "--checkpoint.interval=1"]


@pytest.mark.parametrize("mode", ["warn", "skip"])
def test_a_planted_spike_is_named_marked_and_skipped_on_request(tmp_path: Path, data_cache: str, mode: str):
    """Step 7's batch is random tokens (a corrupt shard's): its loss stands above the three steps
    before it; the notice names the step and its eight data windows, the line log and metrics mark
    it, and training.spike=skip drops its update (the weights after step 7 are those after step 6)
    while warn applies it. No other step is called a spike."""
    run_dir = tmp_path / mode
    proc = run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}", *SPIKE,
                    f"--training.spike={mode}"])
    notices = [ln for ln in proc.stdout.splitlines() if "loss spike" in ln]
    assert len(notices) == 1 and notices[0].startswith("notice: step 7: loss spike"), proc.stdout[-3000:]
    assert f"its update was {'skipped' if mode == 'skip' else 'applied'}" in notices[0]
    assert len(re.findall(r"kjv:\d+", notices[0])) == 8, notices[0]
    assert re.search(r"step 7/8 \| loss [\d.]+ \| SPIKE [\d.]+x", proc.stdout), proc.stdout[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if "spike" in r] == [7]
    spike = next(r for r in rows if r["step"] == 7)
    mean = sum(r["loss"] for r in rows if r["step"] in (4, 5, 6)) / 3
    assert spike["spike"] == pytest.approx(spike["loss"] / mean) and spike["spike"] > 1.2
    p6, p7 = (checkpoint_params(run_dir / "checkpoints" / f"step-{s}") for s in (6, 7))
    unchanged = all(torch.equal(p6[k], p7[k]) for k in p6)
    assert unchanged == (mode == "skip")
    if mode == "skip":
        assert [r["spikes_skipped"] for r in rows] == [0] * 6 + [1, 1]
    # the window the notice names is the step's own data (here replaced by the planted tokens)
    shown = run_cli(["prepare", "--config", "configs/debug.toml", f"--data.cache_dir={data_cache}",
                     "--training.seq_len=64", "--show-window", re.search(r"kjv:\d+", notices[0]).group()])
    assert re.search(r"^kjv:\d+: 64 tokens from \d+ document\(s\), \d+ of its labels out of the loss\n.+",
                     shown.stdout, re.M), shown.stdout
