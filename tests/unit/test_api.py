"""shardwise from Python (shardwise/api.py), as a notebook uses it: train, read the run, load it and
generate, silence the output through the ``shardwise`` logger, get a bad value as an exception."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_cli

# TINY_ARGS as the API's section dicts
TINY = {"model": {"qk_norm": False, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "multiple_of": 16},
        "training": {"seq_len": 64, "global_batch": 8, "steps": 2, "mixed_precision": "fp32"},
        "lr_scheduler": {"warmup_steps": 1}, "eval": {"interval": 0},
        "checkpoint": {"interval": 0, "final": True},
        "metrics": {"tensorboard": False, "plot": False, "log_format": "line"},
        "compile": {"enabled": False}}


def test_import_shardwise_and_its_api_stay_light_until_a_call():
    code = ("import sys, shardwise; light = 'torch' not in sys.modules; f = shardwise.train; "
            "print(light, callable(f), callable(shardwise.plan), callable(shardwise.verify), "
            "'torch' in sys.modules); "
            # the planner's and verify's packages keep their modules and stay the calls once imported
            "import shardwise.plan.search as s; import shardwise.verify.shrink as v; "
            "print(callable(shardwise.plan), s.plan.__name__, callable(shardwise.verify), v.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True", "True", "False", "True", "plan", "True",
                                  "shardwise.verify.shrink"]


def test_train_read_load_generate_and_silence_from_python(tmp_path: Path, data_cache: str, capsys):
    import shardwise

    sections = {**TINY, "data": {"cache_dir": data_cache}, "run": {"dir": str(tmp_path / "nb")}}
    hook = sys.excepthook
    run = shardwise.train(ROOT / "configs" / "debug.toml", **sections)
    assert sys.excepthook is hook  # (its process group leaves no "[rank0]:" traceback prefix behind)
    out = capsys.readouterr().out
    assert run.dir == tmp_path / "nb" and [r["step"] for r in run.metrics] == [1, 2]
    assert run.checkpoint == tmp_path / "nb" / "checkpoints" / "step-2"
    assert "step 2/2 | loss" in out  # the run's lines, printed as the command line prints them
    model = shardwise.load(run.dir)
    text = model.generate("In the beginning", max_new_tokens=6)
    theirs = json.loads(run_cli(["generate", "--checkpoint", str(run.dir), "--prompt", "In the beginning",
                                 "--max-new-tokens", "6", "--json"]).stdout)
    assert text == theirs["text"]
    # the shardwise logger: a handler of one's own takes the run's lines instead of shardwise's
    # printing one, and a level above INFO silences them
    from shardwise.config.notice import say

    log = logging.getLogger("shardwise")
    got: list[str] = []
    mine = logging.Handler()
    mine.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    theirs_handlers, before = list(log.handlers), log.level
    log.handlers[:] = [mine]
    try:
        shardwise.train(ROOT / "configs" / "debug.toml",
                        **{**sections, "run": {"dir": str(tmp_path / "mine")}})
        assert "step 2/2" not in capsys.readouterr().out
        assert any(m.startswith("2") and "step 2/2 | loss" in m for m in got)
        log.handlers[:] = theirs_handlers
        log.setLevel(logging.WARNING)
        say("step 3/3 | a progress line")
        say("warning: a warning", err=True)
        said = capsys.readouterr()
        assert said.out == "" and said.err == "warning: a warning\n"
    finally:
        log.handlers[:] = theirs_handlers
        log.setLevel(before)


def test_a_bad_value_is_an_exception_with_the_command_lines_message(tmp_path: Path):
    import shardwise

    with pytest.raises(shardwise.ConfigError, match="training.steps must be > 0"):
        shardwise.train(training={"steps": 0}, run={"dir": str(tmp_path / "r")})
    with pytest.raises(shardwise.ConfigError, match="give a config section as a dict"):
        shardwise.train(training=5)
    with pytest.raises(shardwise.ConfigError, match="neither a checkpoint, a run directory"):
        shardwise.load(tmp_path / "none")
    assert not (tmp_path / "r").exists()


def test_plan_from_python_is_the_plan_command(tmp_path: Path):
    import shardwise

    hook = sys.excepthook
    p = shardwise.plan(model="debug", nproc=2, top=2)
    assert sys.excepthook is hook  # (the planner's process groups leave no "[rankN]:" traceback prefix)
    cli = run_cli(["plan", "--model", "debug", "--nproc", "2", "--top", "2",
                   "--out", str(tmp_path / "cli.toml")])
    table = cli.stdout.split("\n(")[0]  # (then the search's time and where the best was written)
    assert p.table == table and len(p.estimates) == 2 and p.feasible >= 2 and p.why_nothing == ""
    assert str(p.best.layout) in p.table
    launch = p.write(tmp_path / "api.toml")
    written = (tmp_path / "cli.toml").read_text().replace("cli.toml", "api.toml")
    assert (tmp_path / "api.toml").read_text() == written
    assert launch == f"torchrun --nproc-per-node 2 -m shardwise train --config {tmp_path / 'api.toml'}"
    assert f"{tmp_path / 'cli.toml'}: torchrun --nproc-per-node 2" in cli.stdout  # the CLI says the same
    with pytest.raises(shardwise.ConfigError, match="pass overwrite=True"):
        p.write(tmp_path / "api.toml")
    # nothing fits: the reason, and nothing to write
    none = shardwise.plan(model="8b", nproc=1, top=1)  # 8B's fp32 states alone are 128 GB
    # a [model] section as a dict, as train takes it: the debug preset at twice its depth
    deeper = shardwise.plan(model={"n_layers": 12}, nproc=2, top=1)
    assert deeper.table.split("\n")[0] != p.table.split("\n")[0] and "debug" in deeper.table
    assert none.best is None and none.why_nothing and none.estimates == []
    with pytest.raises(shardwise.ConfigError, match="nothing to write"):
        none.write(tmp_path / "none.toml")


def test_verify_from_python_returns_each_layouts_verdict(tmp_path: Path, data_cache: str, capsys):
    """``shardwise.verify`` on 2 simulated ranks: the passing layout and one with its learning rate
    off by a half, as objects (the command's table printed too); a bad value is the command's
    one-line message as an exception, before any run."""
    import shardwise

    sections = {**TINY, "data": {"cache_dir": data_cache}}
    v = shardwise.verify(ROOT / "configs" / "debug.toml", ranks=2, steps=2, out=tmp_path / "v",
                         layouts=["dp_shard=2", "dp_shard=2,optimizer.lr=0.0015"], **sections)
    ok, off = v.results
    assert (ok.layout, ok.ranks, ok.passed) == ("dp_shard=2", 2, True) and ok.loss_rel <= v.tolerance.loss_rel
    assert not off.passed and off.param_rel > v.tolerance.param_rel and not v.passed
    assert v.out == tmp_path / "v" and (v.out / "loss_overlay.png").exists()
    assert "| dp_shard=2 | 2 |" in capsys.readouterr().out
    with pytest.raises(shardwise.ConfigError, match="--ranks must be 2..1024"):
        shardwise.verify(ranks=1, out=tmp_path / "none")
    assert not (tmp_path / "none").exists()
