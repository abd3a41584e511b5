"""First contact with the CLI: config errors answered before torch is imported, one name for the number
of ranks, ``--model`` wherever a preset can be named, and ``--help`` with defaults and examples."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.commands import COMMANDS, build_parser, common
from shardwise.config.types import ConfigError
from shardwise.resolve.layouts import fill_layouts
from tests.helpers import ROOT

pytestmark = pytest.mark.e2e

# Runs the CLI in a fresh interpreter and records whether torch was loaded once the answer is out (at
# the exit of main, after the error line: the handler that prints it must not load torch either).
_PROBE = """
import sys
from shardwise.config import types as config_types
seen = []
orig = config_types.ConfigError.__init__
def record(self, *a, **k):
    seen.append(("torch" in sys.modules, str(a[0]) if a else ""))
    orig(self, *a, **k)
config_types.ConfigError.__init__ = record
from shardwise.cli import main
from shardwise.config.types import ConfigError
from shardwise.resolve.layouts import fill_layouts
code = main(sys.argv[1:])
print(code, "torch" in sys.modules, seen[-1][1] if seen else "", sep="|")
"""


def _probe(argv: list[str], tmp_path: Path) -> tuple[int, bool, str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    code, torch_loaded, text = out.stdout.strip().splitlines()[-1].split("|", 2)
    return int(code), torch_loaded == "True", text


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--training.stpes", "5"], "unknown config key 'training.stpes'"),
    (["train", "--config", str(ROOT / "configs" / "debug.toml"), "--training.stpes", "5"],
     "unknown config key 'training.stpes'"),
    (["train", "--training.steps", "five"], "expects int"),
    (["train", "--config", "missing.toml"], "does not exist"),
    (["train", "--config", "broken.toml"], "is not valid TOML"),
    (["train", "--model.name", "80b"], "is not a preset"),
    (["train", "--model", "80b"], "is not a preset"),
    (["train", "--nproc", "2", "--parallel.tp", "4"], "world size 2 is not divisible"),
    (["train", "--parallel.dp_shard", "2"], "!= world size 1"),
    (["estimate", "--nproc", "4", "--parallel.tp", "3"], "world size 4 is not divisible"),
    (["estimate", "--nproc", "8", "--training.seq_len", "long"], "expects int"),
    (["plan", "--nproc", "8", "--model", "80b"], "is not a preset"),
    (["plan", "--nproc", "8", "--config", "broken.toml"], "is not valid TOML"),
    (["verify", "--nproc", "4", "--layouts", "tp=3"], "do not divide --nproc 4"),
    (["verify", "--layouts", "tp=2", "--optimizer.lrr", "1"], "unknown config key 'optimizer.lrr'"),
    (["prepare", "--data.shard_mb", "big"], "expects float"),
    (["eval", "--checkpoint", "nowhere"], "--checkpoint 'nowhere' does not exist"),
    (["generate", "--checkpoint", "nowhere", "--prompt", "hi"], "does not exist"),
])
def test_config_errors_answer_before_torch_is_imported(argv: list[str], fragment: str, tmp_path: Path):
    (tmp_path / "broken.toml").write_text("[training\nsteps = 3\n")
    code, torch_loaded, text = _probe(argv, tmp_path)
    assert code == 2 and fragment in text, text
    assert not torch_loaded, f"torch was imported before the answer: {text}"


def test_the_probe_sees_torch_when_it_is_loaded(tmp_path: Path):
    """The check above can fail: an error raised after a training run's torch work is seen as such."""
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    code, torch_loaded, text = _probe(["eval", "--checkpoint", str(ckpt)], tmp_path)
    assert code == 2 and torch_loaded, text


@pytest.mark.parametrize("old", ["--gpus", "--world"])
def test_older_names_of_nproc_work_with_a_notice(old: str, tmp_path: Path, capsys):
    command = "plan" if old == "--gpus" else "estimate"
    argv = [command, "--config", str(ROOT / "configs/debug.toml"), old, "2", "--hardware", "h100"]
    argv += ["--out", str(tmp_path / "p.toml")] if command == "plan" else []
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"notice: {old} is now --nproc" in out
    assert ("on 2 x h100" if command == "plan" else "on 2 ranks") in out, out[:400]


def test_model_names_a_preset_in_estimate_and_train(capsys):
    assert main(["estimate", "--model", "125m", "--nproc", "2", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "notice: --model 125m: starting from 125m.toml" in out
    assert main(["train", "--model", "125m", "--print-config"]) == 0
    toml = capsys.readouterr().out
    assert 'name = "125m"' in toml
    # its own TOML's shape, not the built-in defaults' (debug: seq 256)
    assert "seq_len = 2048" in toml or "seq_len = 1024" in toml, toml


def test_verify_nproc_fills_and_checks_layouts():
    assert fill_layouts(None, 4) == ["dp_shard=4", "tp=2,dp_shard=2"]
    assert fill_layouts(None, 3) == ["dp_shard=3"]
    assert fill_layouts(None, 4, experts=True) == ["dp_shard=4", "tp=2,dp_shard=2", "ep=2,tp=2,dp_shard=2"]
    assert fill_layouts(None, 2, experts=True) == ["dp_shard=2", "tp=2,dp_shard=1", "ep=2,dp_shard=2"]
    assert fill_layouts(["tp=2", "dp_shard=2,tp=2"], 4) == ["tp=2,dp_shard=2", "dp_shard=2,tp=2"]
    assert fill_layouts(["tp=2"], None) == ["tp=2"]
    with pytest.raises(ConfigError, match="uses 2 ranks, not --nproc 4"):
        fill_layouts(["dp_shard=2"], 4)
    with pytest.raises(ConfigError, match="--layouts .* or --nproc N"):
        fill_layouts(None, None)


def test_help_shows_defaults_and_ends_with_examples_that_parse(capsys):
    parser, commands = build_parser()
    examples_of = {name: m.EXAMPLES for name, m in COMMANDS.items()}
    top = parser.format_help().rstrip().splitlines()
    assert top[-len(examples_of) - 1].startswith("examples") and len(commands) == len(examples_of)
    for name, sub in commands.items():
        text = sub.format_help()
        assert text.rstrip().splitlines()[-len(examples_of[name]) - 1] == "examples:", name
    assert "(default: h100)" in commands["plan"].format_help()
    assert "(default: 20)" in commands["verify"].format_help()
    assert "(default: None)" not in "".join(c.format_help() for c in commands.values())
    for name, examples in examples_of.items():
        for example in examples:
            words = shlex.split(example)
            words = words[words.index("shardwise") + 1:] if "shardwise" in words else words[3:]
            args, rest = parser.parse_known_args(words)
            assert args.command == name, example
            common.check_unknown_flags(commands[name], rest)
            common.apply_model(args, rest)
