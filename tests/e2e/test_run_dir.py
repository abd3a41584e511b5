"""A run directory is never destroyed or silently replaced (through the real CLI).

Every combination of overwrite, resume, checkpoint.path and retention that could lose work: each
test fails on a shardwise that deletes, replaces or truncates what the user did not ask to lose.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise import checkpoint
from shardwise.config.outputs import RECORD_NAME, RunRecord
from shardwise.launch.rundir import LOCK_NAME, clear_outputs
from tests.helpers import ROOT, TINY_ARGS, flip_byte, metrics, train_tiny, truncate_shard

pytestmark = pytest.mark.e2e


def train(run_dir: Path, cache: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return train_tiny(run_dir, cache, *extra, check=check)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (the lock file aside) with its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error:"), lines
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    """A finished 4-step run with checkpoints step-2 and step-4 (kept read-only: tests copy it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(run_dir, data_cache, "--training.steps=4", "--checkpoint.interval=2", "--checkpoint.final=true")
    return run_dir


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


def test_overwrite_keeps_the_checkpoint_it_loads(finished: Path, tmp_path: Path, data_cache: str):
    """`--run.overwrite true --checkpoint.path run.dir/checkpoints/step-2`: the old run's outputs go,
    the checkpoint to load stays and is loaded (the run continues at step 3)."""
    run_dir = copy_of(finished, tmp_path)
    (run_dir / "notes.txt").write_text("mine")
    step2 = run_dir / "checkpoints" / "step-2"
    manifest = (step2 / checkpoint.MANIFEST).read_bytes()
    proc = train(run_dir, data_cache, "--run.overwrite=true", f"--checkpoint.path={step2}",
                 "--training.steps=3", "--checkpoint.final=true")
    assert f"kept {step2}, which this run loads" in proc.stdout
    assert [r["step"] for r in metrics(run_dir)] == [3]
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir / "checkpoints")] == [2, 3]
    assert (step2 / checkpoint.MANIFEST).read_bytes() == manifest  # loaded, not rewritten
    assert (run_dir / "notes.txt").read_text() == "mine"  # not a training output: kept


def test_overwrite_removes_exactly_what_the_runs_recorded(tmp_path: Path):
    """The run record lists what runs wrote: those go; a user's files beside or inside them (an
    ``hf/my-llama``, a ``config.base.toml``, a note in checkpoints/) stay, and so do the folders
    holding them."""
    run_dir = tmp_path / "run"
    record = RunRecord(run_dir)
    for rel in ("checkpoints/step-1", "hf/step-1", "tb"):
        if "/" in rel:
            record.make_dir(rel.split("/")[0])
        record.note(rel, "tree")  # a folder a run writes wholly
        (run_dir / rel).mkdir()
        (run_dir / rel / "data").write_text("x")
    record.make_dir("traces")  # made, still empty: removed
    for name in ("metrics.jsonl", "loss.png", "config.toml"):
        record.note(name, "file")
        (run_dir / name).write_text("x")
    mine = {"hf/my-llama/config.json": "{}", "config.base.toml": "a", "notes.txt": "n",
            "checkpoints/README": "r", "report/index.html": "h"}
    for rel, text in mine.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    removed = clear_outputs(run_dir)
    assert removed == ["checkpoints/step-1", "config.toml", "hf/step-1", "loss.png", "metrics.jsonl",
                       "tb", "traces"]
    assert {str(p.relative_to(run_dir)): p.read_text() for p in run_dir.rglob("*") if p.is_file()
            and p.name != RECORD_NAME} == mine
    assert RunRecord(run_dir).entries() == {"checkpoints": "dir", "hf": "dir"}  # what is left of it


def test_overwrite_refuses_a_folder_that_never_held_a_run(tmp_path: Path, data_cache: str):
    """`--run.overwrite true` on a folder of the user's (no run record): one line, nothing removed."""
    run_dir = tmp_path / "mine"
    for rel in ("hf/my-llama/config.json", "config.base.toml", "checkpoints/step-3/weights.bin"):
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(rel)
    before = snapshot(run_dir)
    line = one_error_line(train(run_dir, data_cache, "--run.overwrite=true", "--training.steps=1",
                                check=False))
    assert "no record of a shardwise run" in line and "nothing there is removed" in line, line
    assert snapshot(run_dir) == before


def test_overwrite_refuses_a_run_from_before_the_record(tmp_path: Path):
    """A run directory an older shardwise wrote (a logged run, no record): what it wrote is not known,
    so nothing is removed; the line says how to start over."""
    from shardwise.config.types import ConfigError
    from shardwise.launch.rundir import overwrite_plan

    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (run_dir / "hf").mkdir()
    with pytest.raises(ConfigError, match="written before shardwise kept a record .* delete the folder"):
        overwrite_plan(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["hf", "metrics.jsonl"]


@pytest.mark.parametrize("checkpoint_path", [False, True], ids=["plain", "with_checkpoint_path"])
def test_overwrite_never_follows_a_link_out_of_the_run_dir(checkpoint_path: bool, finished: Path,
                                                            tmp_path: Path, data_cache: str):
    """run.dir/checkpoints is a link to a folder elsewhere that also holds other files: overwrite
    removes nothing through it (it was an rmtree of the target, or a traceback)."""
    run_dir = copy_of(finished, tmp_path)
    elsewhere = tmp_path / "scratch"
    shutil.move(run_dir / "checkpoints", elsewhere)
    (elsewhere / "other-project.bin").write_text("theirs")
    (run_dir / "checkpoints").symlink_to(elsewhere)
    before, outside = snapshot(run_dir), snapshot(elsewhere)
    extra = [f"--checkpoint.path={elsewhere / 'step-2'}"] if checkpoint_path else []
    line = one_error_line(train(run_dir, data_cache, "--run.overwrite=true", "--training.steps=3", *extra,
                                check=False))
    assert "is a link" in line and "nothing is removed through a link" in line, line
    assert snapshot(run_dir) == before and snapshot(elsewhere) == outside


@pytest.mark.parametrize("args", [[], ["ckpt"]], ids=["plain", "with_checkpoint_path"])
def test_a_fresh_run_never_lands_on_an_old_one(args: list[str], finished: Path, tmp_path: Path,
                                               data_cache: str):
    """With or without --checkpoint.path, a run directory that holds a run is refused, untouched."""
    run_dir = copy_of(finished, tmp_path)
    before = snapshot(run_dir)
    extra = [f"--checkpoint.path={run_dir / 'checkpoints' / 'step-2'}"] if args else []
    line = one_error_line(train(run_dir, data_cache, "--training.steps=6", *extra, check=False))
    assert "already holds a run (checkpoints step-2, step-4 and metrics.jsonl with 4 logged step(s))" in line
    assert "--checkpoint.resume true" in line and "--run.overwrite true" in line
    assert snapshot(run_dir) == before


def test_resume_and_overwrite_together_are_refused(finished: Path, tmp_path: Path, data_cache: str):
    run_dir = copy_of(finished, tmp_path)
    before = snapshot(run_dir)
    line = one_error_line(train(run_dir, data_cache, "--checkpoint.resume=true", "--run.overwrite=true",
                                check=False))
    assert "contradict each other" in line
    assert snapshot(run_dir) == before


def test_resuming_an_older_checkpoint_here_is_refused(finished: Path, tmp_path: Path, data_cache: str):
    """Resuming from step-2 in a run dir that has step-4 would write a second history over step-4."""
    run_dir = copy_of(finished, tmp_path)
    before = snapshot(run_dir)
    line = one_error_line(train(run_dir, data_cache, "--checkpoint.resume=true", "--training.steps=6",
                                f"--checkpoint.path={run_dir / 'checkpoints' / 'step-2'}", check=False))
    assert "is step 2, but run.dir" in line and "has the later step-4" in line
    assert snapshot(run_dir) == before


def test_resume_appends_to_the_log_and_drops_only_rows_past_the_checkpoint(tmp_path: Path, data_cache: str):
    """An interrupted run logged step 3 after its step-2 checkpoint: the resumed run keeps rows 1-2 as
    they were, drops row 3 with a notice, and appends its own 3..5."""
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, "--training.steps=3", "--checkpoint.interval=2", "--checkpoint.final=false")
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1')  # a line cut by a crash
    proc = train(run_dir, data_cache, "--training.steps=5", "--checkpoint.resume=true")
    assert "metrics.jsonl: dropped 2 record(s) logged after step 2" in proc.stdout
    now = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert now[:2] == rows[:2]
    assert [json.loads(r)["step"] for r in now] == [1, 2, 3, 4, 5]


def test_resume_with_no_checkpoint_starts_fresh_and_says_so(tmp_path: Path, data_cache: str):
    run_dir = tmp_path / "run"
    proc = train(run_dir, data_cache, "--training.steps=2", "--checkpoint.resume=true")
    assert "checkpoint.resume: no checkpoint in" in proc.stdout and "starting at step 1" in proc.stdout
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_resume_when_no_checkpoint_verifies_stops_with_one_line(damage: str, finished: Path, tmp_path: Path,
                                                                data_cache: str):
    """Truncated (seen by sizes, before any process group) or tampered (seen by checksums inside the
    ranks): exit 2 naming each damaged checkpoint and the ways on; nothing in run.dir changes."""
    run_dir = copy_of(finished, tmp_path)
    for s in (2, 4):  # a flipped byte keeps the size: only the checksum (in the ranks) sees it
        (flip_byte if damage == "tamper" else truncate_shard)(run_dir / "checkpoints" / f"step-{s}")
    before = snapshot(run_dir)
    line = one_error_line(train(run_dir, data_cache, "--training.steps=6", "--checkpoint.resume=true",
                                check=False))
    assert "none of the 2 checkpoint(s)" in line and "step-4 is " in line and "step-2 is " in line
    assert "--checkpoint.path" in line and "--run.overwrite true" in line
    assert snapshot(run_dir) == before


def test_resume_skips_a_damaged_checkpoint_and_sets_it_aside(finished: Path, tmp_path: Path, data_cache: str):
    """The newest checkpoint fails its checksum: the run resumes from the one before, and the damaged
    one is renamed (kept for inspection), not overwritten when the run saves that step again."""
    run_dir = copy_of(finished, tmp_path)
    flip_byte(run_dir / "checkpoints" / "step-4")
    damaged_bytes = snapshot(run_dir / "checkpoints" / "step-4")
    proc = train(run_dir, data_cache, "--training.steps=4", "--checkpoint.resume=true",
                 "--checkpoint.final=true")
    assert "resumed from" in proc.stdout and "step-2 at step 2" in proc.stdout
    assert "set aside as 'step-4.damaged-" in proc.stderr
    (aside,) = (run_dir / "checkpoints").glob("step-4.damaged-*")
    assert snapshot(aside) == damaged_bytes
    checkpoint.verify(run_dir / "checkpoints" / "step-4")  # the new step-4


def test_loading_a_checkpoint_of_another_function_is_refused(finished: Path, tmp_path: Path, data_cache: str):
    run_dir = copy_of(finished, tmp_path)
    before = snapshot(run_dir)
    line = one_error_line(train(run_dir, data_cache, "--checkpoint.resume=true", "--training.steps=6",
                                "--model.rope_theta=10000", check=False))
    assert "model.rope_theta=500000.0, this run has model.rope_theta=10000.0" in line
    assert snapshot(run_dir) == before


def _launch(run_dir: Path, cache: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, "-m", "shardwise", "train", *TINY_ARGS,
                             f"--data.cache_dir={cache}", f"--run.dir={run_dir}", *extra], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _processes() -> dict[int, tuple[int, str]]:
    """Every live (not zombie) process: pid -> (parent pid, name), read from /proc (no tool needed)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if rest[0] != "Z":
            found[int(proc.name)] = (int(rest[1]), name)
    return found


def _ranks(launcher: int) -> list[int]:
    """The launcher and its live ranks: the processes named ``shardwise-r<RANK>`` that descend from
    it (forked from its rank server)."""
    procs = _processes()
    return [launcher] + [p for p in _descendants(launcher, procs) if procs[p][1].startswith("shardwise-r")]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if p in _processes()]


def test_ranks_die_with_their_launcher_and_a_live_run_holds_its_directory(tmp_path: Path, data_cache: str):
    """kill -9 of `shardwise train --nproc 2`: both ranks exit within seconds. While it ran, a second
    run on the directory was refused naming the holder; after, the stale holder is taken over."""
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, data_cache, "--nproc=2", "--training.steps=100000", "--checkpoint.interval=5")
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        line = one_error_line(train(run_dir, data_cache, "--checkpoint.resume=true", check=False))
        assert f"is in use by a live run (host {os.uname().nodename}, pid {launcher.pid}" in line
        family = _ranks(launcher.pid)
        assert len(family) == 3  # the launcher and its two ranks
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    killed = time.monotonic()
    while _alive(family) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    assert not _alive(family), "ranks outlived their launcher by 10 s"
    steps = len(metrics(run_dir))
    time.sleep(2)
    assert len(metrics(run_dir)) == steps  # nobody writes any more
    proc = train(run_dir, data_cache, "--checkpoint.resume=true", f"--training.steps={steps + 1}")
    assert f"took over run.dir from a run that is no longer running (host {os.uname().nodename}, pid " \
           f"{launcher.pid}" in proc.stdout
    assert not (run_dir / LOCK_NAME).exists()  # released at the end


@pytest.mark.parametrize("case", ["too_little_data", "tampered_checkpoint"])
def test_an_error_inside_two_ranks_is_one_line_and_exit_2(case: str, finished: Path, tmp_path: Path,
                                                          data_cache: str):
    """Errors that only the ranks can see (the data's sequences, checksums split over the ranks) end the
    launcher with exit 2 and the first failing rank's line -- no launcher traceback."""
    if case == "too_little_data":  # prepared by the launcher; too short for a batch, as the ranks find
        tiny = tmp_path / "tiny.jsonl"
        tiny.write_text('{"text": "In the beginning."}\n{"text": "And the earth was without form."}')
        extra, fragment = [f"--data.path={tiny}"], "data source 'tiny' has no sequence of 64 tokens"
        run_dir = tmp_path / "run"
    else:
        run_dir = copy_of(finished, tmp_path)
        flip_byte(run_dir / "checkpoints" / "step-4")
        extra = [f"--checkpoint.path={run_dir / 'checkpoints' / 'step-4'}", "--checkpoint.resume=true"]
        fragment = "does not match its SHA-256"
    line = one_error_line(train(run_dir, data_cache, "--nproc=2", "--training.steps=6", *extra, check=False))
    assert line.startswith(("shardwise: error: [rank 0] ", "shardwise: error: [rank 1] "))
    assert fragment in line


def _listening(pids: list[int]) -> list[str]:
    """Local addresses ('127.0.0.1:port', '::', ...) of the TCP sockets these processes listen on,
    read from /proc (no tool needed)."""
    import ipaddress

    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = cols[1].split(":")
            raw = bytes.fromhex(addr)
            # /proc prints each 32-bit word of the address little-endian
            ip = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.append(f"{ipaddress.ip_address(ip)}:{int(port, 16)}")
    return found


@pytest.mark.parametrize("restarts", [0, 1])
def test_the_local_launcher_listens_on_loopback_only(restarts: int, tmp_path: Path, data_cache: str):
    """`--nproc 2` (and `--max-restarts 1`, where rank 0 hosts the ranks' store itself): the
    rendezvous store, the ranks' store and gloo all listen on 127.0.0.1 -- nothing on the network
    can join the job (torch's TCPStore server alone would bind every interface)."""
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, data_cache, "--nproc=2", "--training.steps=100000",
                       f"--max-restarts={restarts}")
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        pids = _ranks(launcher.pid)
        assert len(pids) == 3
        addresses = _listening(pids)
        assert addresses and all(a.startswith(("127.0.0.1:", "::1:")) for a in addresses), addresses
        assert _listening([launcher.pid])  # the launcher's own rendezvous store is among them
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)


def _descendants(root: int, procs: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """The live processes below ``root`` (from :func:`_processes`, read now unless given)."""
    procs = _processes() if procs is None else procs

    def under(pid: int) -> bool:
        while pid > 1 and pid in procs:
            if pid == root:
                return True
            pid = procs[pid][0]
        return False

    return [p for p in procs if under(p)]


@pytest.mark.slow  # (22 s: a full collective calibration)
def test_calibrates_gloo_workers_listen_on_loopback_only(tmp_path: Path):
    """calibrate's collective measurement: its gloo processes (forked from the rank server) listen on
    127.0.0.1 only, like training's ranks."""
    script = ("from shardwise.plan.calibrate import collective_bandwidth\n"
              "if __name__ == '__main__':\n    collective_bandwidth(2, (1, 4, 16, 64))\n")
    (tmp_path / "cal.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "cal.py")], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seen: set[str] = set()
    try:
        while proc.poll() is None:
            with contextlib.suppress(OSError):  # (a process may exit while it is read)
                seen |= set(_listening(_descendants(proc.pid)))
            time.sleep(0.05)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert seen and all(a.startswith(("127.0.0.1:", "::1:")) for a in seen), seen


def test_the_quick_exit_keeps_what_a_normal_exit_keeps(tmp_path: Path):
    """Every command leaves through ``quick_exit`` (no interpreter teardown): it still waits for a
    running non-daemon thread, stops a thread pool nothing shut down (its idle workers are
    non-daemon threads: joining them first would wait forever), runs the exit handlers, writes what
    an unclosed file buffered, and exits with the command's code."""
    out = tmp_path / "left-open.txt"
    script = f"""
import atexit, threading, time
from shardwise.launch.process import quick_exit
f = open({str(out)!r}, "w")
f.write("buffered ")
def late():
    time.sleep(0.5)
    f.write("from a thread")
threading.Thread(target=late).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)  # (held: a collected pool would stop its workers itself)
pool.submit(print, "pool ran", flush=True).result()
atexit.register(lambda: print("exit handler ran", flush=False))
quick_exit(3)
print("never")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "pool ran\nexit handler ran\n"
    assert out.read_text() == "buffered from a thread"


def test_a_profiled_command_exits_normally_so_the_profile_is_written(tmp_path: Path):
    """``python -m cProfile -o FILE -m shardwise ...`` writes FILE after the command returns: under a
    profiler the command exits the normal way, not through ``quick_exit``."""
    out = tmp_path / "estimate.prof"
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "shardwise", "estimate",
                           "--config", "configs/debug.toml", "--nproc", "1", "--hardware", "h100"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
