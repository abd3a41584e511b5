"""shardwise from Python (shardwise/api.py), as a notebook uses it: train, read the run, load it and
generate, silence the output through the ``shardwise`` logger, get a bad value as an exception."""

from __future__ import annotations

import json
import logging
import os
import re
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


def test_estimate_from_python_is_the_estimate_command(tmp_path: Path):
    import shardwise
    from shardwise.plan.estimate import estimate_json

    est = shardwise.estimate(model="debug", nproc=4, parallel={"tp": 2, "dp_shard": 2})
    run_cli(["estimate", "--model", "debug", "--nproc", "4", "--parallel.tp=2", "--parallel.dp_shard=2",
             "--json", str(tmp_path / "e.json")])
    assert estimate_json(est) == (tmp_path / "e.json").read_text()  # every byte, collective and second
    assert (est.layout.tp, est.layout.dp_shard, est.run.world) == (2, 2, 4) and est.fits and est.peak > 0
    with pytest.raises(shardwise.ConfigError, match="parallel"):  # 3 ranks cannot hold tp=2 x dp_shard=2
        shardwise.estimate(model="debug", nproc=3, parallel={"tp": 2, "dp_shard": 2})


def test_eval_and_convert_from_python_are_their_commands(tmp_path: Path, data_cache: str):
    """A tiny run scored by ``shardwise.eval`` (one rank, and two: the scores come back from rank 0)
    as ``shardwise eval --json`` scores it; exported and imported back by ``shardwise.convert`` into
    the files ``shardwise convert`` writes."""
    import shardwise

    run = shardwise.train(ROOT / "configs" / "debug.toml",
                          **{**TINY, "data": {"cache_dir": data_cache}, "run": {"dir": str(tmp_path / "r")}})
    ev = shardwise.eval(run.dir)
    theirs = json.loads(run_cli(["eval", "--checkpoint", str(run.dir), "--json"]).stdout.splitlines()[-1])
    assert [(s["name"], s["loss"], s["tokens"]) for s in theirs["scores"]] == [
        (s.name, s.loss, s.tokens) for s in ev.scores.values()]
    assert ev.loss == theirs["scores"][-1]["loss"] and ev.checkpoint == run.checkpoint and ev.split == "val"
    two = shardwise.eval(run.dir, nproc=2, parallel={"dp_shard": 2})
    assert two.scores.keys() == ev.scores.keys() and two.loss == pytest.approx(ev.loss, rel=1e-5)
    hf = shardwise.convert(to_hf=run.dir, out=tmp_path / "hf", dtype="fp32")
    run_cli(["convert", "--to-hf", str(run.dir), "--out", str(tmp_path / "hf-cli"), "--dtype", "fp32"])
    assert hf.files == [tmp_path / "hf" / "model.safetensors"]
    assert hf.files[0].read_bytes() == (tmp_path / "hf-cli" / "model.safetensors").read_bytes()
    back = shardwise.convert(from_hf=hf.out, out=tmp_path / "ck")
    run_cli(["convert", "--from-hf", str(hf.out), "--out", str(tmp_path / "ck-cli")])
    assert back.toml == tmp_path / "ck.toml" and back.files == []
    assert back.toml.read_text() == (tmp_path / "ck-cli.toml").read_text().replace("ck-cli", "ck")
    with pytest.raises(shardwise.ConfigError, match="--out .* the folder holds files"):
        shardwise.convert(to_hf=run.dir, out=hf.out)


def test_prepare_from_python_is_the_prepare_command(tmp_path: Path):
    import shardwise

    corpus = tmp_path / "corpus.jsonl"  # 400 documents
    corpus.write_text("".join(json.dumps({"text": f"document {i} of a small corpus, with words to tokenize."})
                              + "\n" for i in range(400)))
    data = {"path": str(corpus), "cache_dir": str(tmp_path / "cache")}
    (got,) = shardwise.prepare(ROOT / "configs" / "debug.toml", data=data)
    out = run_cli(["prepare", "--config", str(ROOT / "configs" / "debug.toml"), f"--data.path={corpus}",
                   f"--data.cache_dir={tmp_path / 'cache'}"]).stdout  # (finds it prepared)
    assert got.folder.is_relative_to(tmp_path / "cache") and got.tokens > 0 and got.docs + got.val_docs == 400
    assert (f"{got.folder}: {got.shards} shard(s), {got.docs:,} documents and {got.tokens:,} tokens to train "
            f"on, {got.val_docs:,} documents and {got.val_tokens:,} tokens held out") in out
    with pytest.raises(shardwise.ConfigError, match="synthetic"):
        shardwise.prepare(data={"synthetic": True})


_DOWNLOAD = """
import json, sys
import shardwise
model = shardwise.download("org/tiny", out=sys.argv[1])
cached = shardwise.download("hf://datasets/org/corpus/data")
try:
    shardwise.download("org/tiny", out=sys.argv[1])
    said = ""
except shardwise.ConfigError as e:
    said = str(e)
print(json.dumps([model.kind, str(model.folder), cached.kind, str(cached.folder), said]))
"""


def test_download_from_python_is_the_download_command(tmp_path: Path):
    """``shardwise.download`` from a local server answering as the Hub does, into a folder and into
    the cache, with the files ``shardwise download --out`` fetches (in a fresh interpreter:
    huggingface_hub reads HF_ENDPOINT when it loads)."""
    from tests.helpers import cli_env, fake_hub

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    for name, text in {"config.json": "{}", "model.safetensors": "weights", "tokenizer.json": "{}",
                       "modeling_x.py": "import os", "data/train.jsonl": '{"text": "a"}\n'}.items():
        (repo / name).write_text(text)
    with fake_hub({"org/tiny": repo, "datasets/org/corpus": repo}) as (url, _):
        env = {**cli_env(), "HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": url, "PYTHONPATH": str(ROOT)}
        env.pop("HF_HUB_OFFLINE", None)
        proc = subprocess.run([sys.executable, "-c", _DOWNLOAD, str(tmp_path / "api")], env=env,
                              capture_output=True, text=True, timeout=120, check=True)
        run_cli(["download", "org/tiny", "--out", str(tmp_path / "cli")], env=env)
    kind, folder, dkind, dfolder, said = json.loads(proc.stdout.splitlines()[-1])
    assert (kind, folder, dkind) == ("model", str(tmp_path / "api"), "dataset")
    files = [sorted(n for n in os.listdir(f) if not n.startswith(".")) for f in (folder, tmp_path / "cli")]
    assert files[0] == files[1] == ["config.json", "model.safetensors", "tokenizer.json"]  # (no code)
    assert Path(dfolder).is_relative_to(tmp_path / "home") and Path(dfolder, "train.jsonl").is_file()
    assert "the folder holds files" in said


_RANK_FAILS = """
import json, sys
import shardwise
from shardwise.api import _flags
from shardwise.cli import main
config, sections = sys.argv[1], json.loads(sys.argv[2])
code = main(["train", "--config", config, "--nproc", "2", *_flags(sections)])
print("exit", code, flush=True)
try:
    shardwise.train(config, nproc=2, **{**sections, "run": {"dir": sections["run"]["dir"] + "-api"}})
except RuntimeError as e:
    print(type(e).__name__, e)
"""


def test_a_rank_that_fails_is_named_with_its_error_line_by_the_command_and_the_call(tmp_path: Path,
                                                                                    data_cache: str):
    """Rank 1 of a 2-rank run raises (a planted fault): the command's last line and the exception
    ``shardwise.train(nproc=2)`` raises both name rank 1 and its error."""
    from tests.helpers import cli_env

    env = {**cli_env(), "SHARDWISE_TEST_FAULT": "rank1_raises",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "faults"), str(ROOT)])}
    sections = {**TINY, "data": {"cache_dir": data_cache}, "run": {"dir": str(tmp_path / "r")}}
    proc = subprocess.run([sys.executable, "-c", _RANK_FAILS, str(ROOT / "configs" / "debug.toml"),
                           json.dumps(sections)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (how many ranks the launcher counts as failed depends on whether rank 0 lost its peer before
    # the agent stopped it: 1 or 2)
    line = (r"[12] of 2 ranks failed \(first: rank 1: RuntimeError: planted: rank 1 fails at its first "
            r"step\); see its traceback above")
    assert re.search(rf"^shardwise: error: {line}$", proc.stderr, re.M), proc.stderr[-3000:]
    assert "exit 1" in proc.stdout.splitlines()
    assert re.search(rf"^RanksFailed {line}$", proc.stdout, re.M), proc.stdout[-3000:]
