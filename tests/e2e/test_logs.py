"""What rank 0 prints while training, through the CLI: a progress bar on a terminal, one line (or JSON
object) per log interval when the output goes to a file, as a Slurm job's does."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from shardwise.observe.metrics import console_record, format_line
from tests.helpers import ROOT, TINY_ARGS

pytestmark = pytest.mark.e2e

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step (\d+)/6 \| loss \d+\.\d{4} \| "
                  r"lr \d\.\d\de[-+]\d\d \| grad \d+\.\d{3} \| tok/s/dev [\d,]+ \| "
                  r"mfu \d+\.\d% \| mem \d+\.\d\d GiB \| eta \d+m\d\ds$")


def _train(tmp_path: Path, *extra: str, terminal: bool = False, both: bool = False) -> tuple[str, str]:
    """Train 6 steps, stdout to a file (and stderr to a file, or to a terminal; ``both``: stdout to
    the terminal too, as an interactive shell has it); both as text."""
    args = [a for a in TINY_ARGS if not a.startswith("--metrics.log_format")]
    cmd = [sys.executable, "-m", "shardwise", "train", *args, "--training.steps=6",
           "--metrics.log_interval=2", f"--run.dir={tmp_path / 'run'}", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    out_path = tmp_path / "out.log"
    if terminal:
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
        with out_path.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=follower if both else out, stderr=follower, env=env)
            os.close(follower)
            chunks = []
            while True:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the terminal closed with the process
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            assert proc.wait(timeout=300) == 0
        os.close(leader)
        return out_path.read_text(), b"".join(chunks).decode(errors="replace")
    with out_path.open("w") as out, (tmp_path / "err.log").open("w") as err:
        subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=err, env=env, check=True, timeout=300)
    return out_path.read_text(), (tmp_path / "err.log").read_text()


def test_output_to_a_file_gets_one_line_per_log_interval(tmp_path: Path, data_cache: str):
    out, err = _train(tmp_path, f"--data.cache_dir={data_cache}")  # metrics.log_format=auto
    steps = [int(m.group(1)) for line in out.splitlines() if (m := LINE.match(line))]
    assert steps == [2, 4, 6], out
    assert "\r" not in out + err and "train:" not in err  # no bar, nor its carriage returns
    assert out.splitlines()[-1] != ""


def test_json_lines_carry_the_same_fields(tmp_path: Path, data_cache: str):
    out, _ = _train(tmp_path, f"--data.cache_dir={data_cache}", "--metrics.log_format=json",
                    "--checkpoint.interval=3")
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [2, 4, 6] and all(r["total"] == 6 for r in steps)
    assert {"time", "loss", "lr", "grad_norm", "tokens_per_s_per_device", "mfu", "memory_gib",
            "eta_s"} <= steps[0].keys()
    assert steps[-1]["eta_s"] == 0
    assert any("checkpoint" in r.get("message", "") for r in records), records  # messages stay JSON too


def test_a_terminal_gets_the_bar(tmp_path: Path, data_cache: str):
    _, terminal = _train(tmp_path, f"--data.cache_dir={data_cache}", terminal=True, both=True)
    assert "train:" in terminal and "6/6" in terminal and "\r" in terminal, terminal[-500:]
    assert not any(LINE.match(line.strip("\r")) for line in terminal.splitlines()), terminal[-500:]


def test_a_piped_stdout_gets_lines_though_stderr_is_a_terminal(tmp_path: Path, data_cache: str):
    """`shardwise train ... | tee log` (or `> log`): stdout is the pipe, stderr still the terminal; the
    log keeps a line per logged step (the bar on stderr used to leave it without any)."""
    out, terminal = _train(tmp_path, f"--data.cache_dir={data_cache}", terminal=True)
    assert [int(m.group(1)) for line in out.splitlines() if (m := LINE.match(line))] == [2, 4, 6], out
    assert "train:" not in terminal, terminal[-500:]


def test_the_line_counts_down_to_the_end():
    rec = console_record(150, 200, {"loss": 2.5, "lr": 3e-4, "grad_norm": 0.5, "mfu": 0.412,
                                    "tokens_per_s_per_device": 1234.5, "memory_gib": 71.25,
                                    "step_time_s": 4.0, "val_loss": 2.6},
                         now=0.0)
    assert rec["eta_s"] == 200.0
    line = format_line(rec)
    assert line.endswith("step 150/200 | loss 2.5000 | val 2.6000 | lr 3.00e-04 | grad 0.500 | "
                         "tok/s/dev 1,234 | mfu 41.2% | mem 71.25 GiB | eta 3m20s"), line
    assert format_line({**rec, "eta_s": 3 * 3600 + 61}).endswith("eta 3h01m")
