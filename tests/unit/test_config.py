"""Config parsing: every preset file, overrides, and one-line errors for bad keys and values."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.commands.train import field_docs, help_text
from shardwise.config.schema import Config, ConfigError, parse_overrides, read_config
from shardwise.resolve.checks import load_config
from tests.helpers import ROOT, resolved_config

CONFIGS = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.toml"))


def test_every_preset_file_is_a_model_preset_or_names_one():
    """configs/NAME.toml is the published training shape of preset NAME (``--model NAME`` reads it),
    or a recipe over a preset it names (chat, SFT): none names a model that does not exist."""
    from shardwise.models import PRESETS

    assert {"debug", "moe-debug", "deepseek-debug"} <= {p.stem for p in CONFIGS}
    for path in CONFIGS:
        name = load_config(path).model.name
        assert path.stem in PRESETS or name in PRESETS or name == "", (path.name, name)
        if path.stem in PRESETS:
            assert name == path.stem, (path.name, name)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_preset_file_parses_and_round_trips(path: Path, tmp_path: Path):
    cfg = load_config(path)
    assert cfg.model.dim is not None  # resolved from the preset
    saved = tmp_path / "config.toml"
    saved.write_text(cfg.to_toml())
    assert load_config(saved) == cfg


# The world each shipped config is written for (its header comment says how to launch it).
WORLDS = {"debug": 1, "moe-debug": 2, "chat-debug": 1, "125m": 1, "1b": 8, "8b": 8, "70b": 256, "405b": 512,
          "qwen3-0.6b": 1, "qwen3-30b-a3b": 8, "deepseek-debug": 4, "deepseek-v3-16b": 8,
          "deepseek-v3-671b": 512, "sft-qwen3": 1, "sft-llama3": 8, "sft-deepseek-v3": 512}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_preset_file_fits_its_world_on_h100s(path: Path):
    """``shardwise estimate`` of each shipped config on the GPUs it is written for: the layout
    resolves (degrees, batch split, pipeline schedule) and its per-GPU peak fits an 80 GB H100."""
    from shardwise.plan.estimate import GiB, estimate
    from shardwise.plan.hardware import load_hardware

    assert path.stem in WORLDS, f"give {path.name}'s world size in WORLDS"
    cfg = resolved_config(path, device="cuda")  # planned for GPUs, from this machine
    est = estimate(cfg, WORLDS[path.stem], load_hardware("h100"), exact=False)
    assert est.fits, f"{path.name}: peak {est.peak / GiB:.1f} GiB"
    assert est.tokens_per_s_per_device > 0


def test_overrides_are_typed():
    cfg = load_config(None, ["--training.steps=7", "--lr_scheduler.warmup_steps=2",
                             "--training.mixed_precision", "fp32",
                             "--debug.deterministic", "true", "--optimizer.lr=2e-4",
                             "--parallel.backend_override", "dp_shard=gloo,tp=gloo",
                             "--model.n_layers", "2"])
    assert cfg.training.steps == 7 and cfg.training.mixed_precision == "fp32"
    assert cfg.debug.deterministic is True and cfg.optimizer.lr == 2e-4
    assert cfg.parallel.backend_override == {"dp_shard": "gloo", "tp": "gloo"}
    assert cfg.model.n_layers == 2 and cfg.model.dim == 256  # the rest from the debug preset


def test_none_on_the_command_line_is_a_choice_where_the_field_has_it():
    """model.moe_balance=none turns balancing off (it was read as "unset" and the file's choice kept,
    silently); for a field without a "none" choice, none still unsets it (the preset's value)."""
    cfg = load_config(ROOT / "configs" / "moe-debug.toml", ["--model.moe_balance=none", "--model.dim=none"])
    assert cfg.model.moe_balance == "none" and cfg.model.dim == 256
    assert load_config(ROOT / "configs" / "moe-debug.toml", []).model.moe_balance == "aux_loss"


def test_cli_overrides_beat_the_file(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 50\nseq_len = 128\n")
    cfg = load_config(f, ["--training.steps", "3", "--lr_scheduler.warmup_steps", "1"])
    assert (cfg.training.steps, cfg.training.seq_len) == (3, 128)


@pytest.mark.parametrize("args,fragment", [
    (["--training.stpes=3"],
     "unknown config key 'training.stpes' on the command line; did you mean 'training.steps'"),
    (["--trainer.steps=3"], "unknown config key 'trainer.steps'"),
    (["--training.steps=three"], "config key 'training.steps' expects int, got 'three'"),
    (["--debug.deterministic=maybe"], "config key 'debug.deterministic' expects bool"),
    (["--training.mixed_precision=fp16"], "training.mixed_precision must be one of bf16, fp32, auto"),
    (["--training.steps=0"], "training.steps must be > 0"),
    (["--training.seq_len=4096"], "training.seq_len=4096 exceeds model.max_seq_len=2048"),
    (["--model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=16"),
    (["--model.name=gpt5"], "model.name 'gpt5' is not a preset"),
    (["--optimizer.beta2=1.5"], "optimizer.beta2 must be in [0, 1)"),
    (["--training.spike_factor=0.9"], "training.spike_factor must be > 1 (or 0: no spike detection)"),
    (["--training.spike_window=0"], "training.spike_window must be > 0"),
    (["--training.spike=drop"], "training.spike"),
    (["--parallel.backend_override=xx=gloo"], "unknown mesh dim 'xx'"),
    (["--parallel.backend_override=gloo"], "expects k=v"),
    (["--training.steps"], "override '--training.steps' has no value"),
    (["--compile.enabled=sometimes"], "compile.enabled must be one of auto, true, false"),
    (["steps=3"], "unexpected argument 'steps=3'"),
])
def test_bad_overrides_fail_with_one_line(args: list[str], fragment: str):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,fragment", [
    ("[training]\nsteps = \"ten\"\n", "expects int, got 'ten'"),
    ("[training]\nsteps = 1.5\n", "expects int"),
    ("[traning]\nsteps = 3\n", "unknown config key 'traning.steps'"),
    ("steps = 3\n", "must be a [section]"),
    ("[training\n", "not valid TOML"),
    ("[compile]\nenabled = 1\n", "compile.enabled must be one of auto, true, false, got 1"),
])
def test_bad_files_fail_with_one_line(tmp_path: Path, text: str, fragment: str):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert fragment in str(e.value) and str(f) in str(e.value) and "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.toml")


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b=1", "--c.d", "x=y"]) == [("a.b", "1"), ("c.d", "x=y")]


def test_every_field_is_documented():
    import dataclasses

    for f in dataclasses.fields(Config):
        section = type(getattr(Config(), f.name))
        docs = field_docs(section)
        missing = [x.name for x in dataclasses.fields(section) if not docs.get(x.name)]
        assert not missing, f"[{f.name}] fields without a docstring: {missing}"
    assert "--training.global_batch" in help_text()


def test_auto_precision_resolves_per_device(monkeypatch: pytest.MonkeyPatch):
    """auto is bf16 on GPUs and on CPUs that multiply bf16 natively, fp32 on other CPUs; the loaded
    config names the dtype, so a saved run resumes with the same one on any machine."""
    import shardwise.runtime.machine as device

    def mp(args: list[str], device: str | None = None) -> str:
        return resolved_config(None, args, device=device).training.mixed_precision

    assert mp(["--training.mixed_precision=auto"], device="cuda") == "bf16"
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(device, "cpu_has_native_bf16", lambda native=native: native)
        assert mp(["--training.mixed_precision=auto", "--run.device=cpu"]) == want
    assert mp(["--training.mixed_precision=bf16", "--run.device=cpu"]) == "bf16"


@pytest.mark.parametrize("text,want", [("", "auto"), ("true", True), ("off", False), ("auto", "auto")])
def test_compile_enabled_takes_auto_or_a_bool(text: str, want: object, tmp_path: Path):
    """compile.enabled is auto, true or false on the command line and in TOML (a bool there), and
    the saved config.toml reads back the same."""
    cfg = load_config(None, [f"--compile.enabled={text}"] if text else [])
    assert cfg.compile.enabled == want and type(cfg.compile.enabled) is type(want)
    f = tmp_path / "c.toml"
    f.write_text(cfg.to_toml())
    assert load_config(f).compile.enabled == want


@pytest.mark.parametrize("args,want,why", [
    (["--training.steps=300"], True, "compiling the blocks and the loss (300 steps amortize"),
    (["--training.steps=299"], False, "eager, 299 steps do not amortize the compile (it compiles from 300)"),
    (["--training.steps=500", "--parallel.pp=2", "--data.document_mask=false"], False,
     "compile with parallel.pp > 1 is not tested yet"),
    (["--training.steps=500", "--parallel.ep=2", "--model.name=moe-debug"], False,
     "compile with parallel.ep > 1 is not tested yet"),
    (["--training.steps=5", "--compile.enabled=true"], True, ""),
    (["--training.steps=500", "--compile.enabled=false"], False, ""),
])
def test_auto_compile_compiles_long_runs_on_tested_layouts(args: list[str], want: bool, why: str):
    """compile.enabled=auto, resolved once per run (ResolvedRun.compile) with the reason preflight
    prints; the planner's step-time model takes the same decision for its layouts."""
    from shardwise.resolve.run import compile_run, resolve_run

    cfg = load_config(None, ["--run.device=cpu", *args])
    run = resolve_run(cfg, 2)
    assert run.compile == want and why in run.compile_reason
    assert bool(why) == bool(run.compile_reason)  # (said for auto only)
    planned = resolve_run(cfg, 2, detect_device=False)
    assert compile_run(cfg, planned.dims, "cuda", toolchain=False)[0] == want


@pytest.mark.parametrize("native", [False, True])
def test_auto_compile_leaves_bf16_eager_on_a_cpu_without_bf16_arithmetic(native: bool,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """A long bf16 run on a CPU without bf16 arithmetic stays eager under auto, and says why (its
    compiled graph skips shardwise.ops.cpu_bf16's fp32 paths); with bf16 arithmetic, or fp32, it compiles."""
    from shardwise.resolve.run import resolve_run
    from shardwise.runtime import machine

    monkeypatch.setattr(machine, "cpu_has_native_bf16", lambda: native)
    for precision, want in (("bf16", native), ("fp32", True)):
        cfg = load_config(None, ["--run.device=cpu", "--training.steps=500",
                                 f"--training.mixed_precision={precision}"])
        run = resolve_run(cfg, 1)
        assert run.compile == want, precision
        assert ("16x slower than eager on a CPU without bf16 arithmetic" in run.compile_reason) == (not want)


def test_compile_without_the_toolchain_is_refused_or_left_off(monkeypatch: pytest.MonkeyPatch):
    """No C++ compiler on a CPU machine: compile.enabled=true fails in one line before any rank
    starts (inductor would fail at the first step); auto stays eager and says why."""
    from shardwise.resolve.run import resolve_run

    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    cfg = load_config(None, ["--run.device=cpu", "--training.steps=500", "--compile.enabled=true"])
    with pytest.raises(ConfigError, match="compile.enabled=true needs a C\\+\\+ compiler "
                                          "\\(no-such-compiler-xyz is not on PATH\\)"):
        resolve_run(cfg, 1)
    cfg.compile.enabled = "auto"
    run = resolve_run(cfg, 1)
    assert not run.compile and "torch.compile needs a C++ compiler" in run.compile_reason


def test_resolving_leaves_the_config_as_it_was():
    """The run the trainer takes is resolved once, and resolving changes nothing it was given: with
    pipeline parallel and no micro-batch, the chosen one is in the run's own config (which the run
    directory's config.toml is), not in the caller's."""
    from shardwise.resolve.run import resolve_run

    cfg = load_config(None, ["--run.device=cpu", "--parallel.pp=2", "--training.global_batch=8"])
    before = cfg.to_toml()
    run = resolve_run(cfg, 2)
    assert cfg.to_toml() == before and cfg.training.micro_batch == 0
    assert run.cfg.training.micro_batch == 1 and run.micro_batches == 8  # 4 * pp micro-batches at least
    assert run.cfg is not cfg and run.cfg.parallel is cfg.parallel  # (a copy of what changed only)


def test_ranks_beyond_the_visible_gpus_are_refused_per_machine(monkeypatch: pytest.MonkeyPatch):
    """One rank per GPU, counted per machine: the launcher's LOCAL_WORLD_SIZE (torchrun across
    nodes), the whole world before a launch, else a launched rank's own index plus one."""
    import torch

    from shardwise.runtime.distributed import check_gpu_count

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    check_gpu_count(2)
    with pytest.raises(ConfigError, match=r"3 ranks on this machine but 2 CUDA .* --nproc 2"):
        check_gpu_count(3)
    monkeypatch.setenv("WORLD_SIZE", "16")  # 2 nodes of 8 ranks, 2 GPUs each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="8 ranks .* torchrun --nproc-per-node 2"):
        check_gpu_count(16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_gpu_count(16)  # 16 ranks over 8 nodes of 2 GPUs
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_gpu_count(16)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="3 ranks"):
        check_gpu_count(16)


# Flags a user writes, among them every one a run adapts (chat's document mask, a warm-up or profiler
# window past the end, auto precision and device, a pipeline without a micro-batch).
WRITTEN = [["--data.format=chat", "--data.format=text"],
           ["--data.document_mask=false", "--data.document_mask=true"],
           ["--training.steps=5", "--training.steps=40"],
           ["--lr_scheduler.warmup_steps=0", "--lr_scheduler.warmup_steps=20"],
           ["--profile.enabled=true", "--profile.enabled=false"], ["--profile.start=3", "--profile.every=10"],
           ["--training.mixed_precision=auto", "--training.mixed_precision=fp32"],
           ["--run.device=auto", "--run.device=cpu"], ["--parallel.pp=2", "--parallel.dp_shard=2"],
           ["--optimizer.lr=0", "--optimizer.lr=1e-3"], ["--model.name=debug", "--model.name=moe-debug"],
           ["--model.n_layers=4", "--model.dim=128"]]


@pytest.mark.parametrize("seed", range(40))
def test_load_config_changes_nothing_the_user_wrote(seed: int):
    """Property, over random command lines: every value load_config returns is the one written (or
    the default), the [model] section only completed; what a run adapts is in run.cfg alone, and
    resolving leaves the loaded config as it was."""
    rng = random.Random(seed)
    args = [rng.choice(pair) for pair in WRITTEN if rng.random() < 0.7]
    written, cfg = read_config(None, args), load_config(None, args)
    for f in dataclasses.fields(Config):
        if f.name != "model":
            assert getattr(cfg, f.name) == getattr(written, f.name), (args, f.name)
    assert {k: v for k, v in dataclasses.asdict(written.model).items() if v is not None}.items() <= \
        dataclasses.asdict(cfg.model).items()
    before = cfg.to_toml()
    from shardwise.resolve.run import resolve_run

    run = resolve_run(cfg, cfg.parallel.pp * max(cfg.parallel.dp_shard, 1), detect_device=False)
    assert cfg.to_toml() == before, args
    r = run.cfg
    assert r.training.mixed_precision != "auto" and r.lr_scheduler.warmup_steps <= r.training.steps
    assert r.data.document_mask or r.data.format != "chat"
    assert not r.profile.enabled or r.profile.start + r.profile.every - 1 <= r.training.steps


def test_a_process_resolves_the_model_tokenizer_and_data_once(tmp_path: Path, data_cache: str):
    """Resolution in one pass: a whole `shardwise train` (a fresh run, then its resume) and `eval` of
    its checkpoint make the ModelArgs, load the tokenizer and work out the data plan once each per
    process (counted by wrapping the one function that does each), and the run carries them on;
    `estimate` and `plan` (which resolves every candidate layout) make the ModelArgs once."""
    count = ("import sys, shardwise.models as m, shardwise.data.prepare as d, shardwise.data.tokenizer as t\n"
             "calls = {}\n"
             "def counted(mod, name):\n"
             "    orig = getattr(mod, name)\n"
             "    setattr(mod, name, lambda *a, **k: calls.__setitem__(name, calls.get(name, 0) + 1)\n"
             "            or orig(*a, **k))\n"
             "counted(m, 'model_args'); counted(d, 'prepare_plan'); counted(t, 'load_tokenizer')\n"
             "from shardwise.cli import main\n"
             "code = main(sys.argv[1:])\n"
             "print('calls:', sorted(calls.items()))\n"
             "sys.exit(code)\n")
    run = ["train", "--config", "configs/debug.toml", "--run.dir", str(tmp_path / "run"),
           f"--data.cache_dir={data_cache}", "--metrics.plot=false", "--metrics.tensorboard=false",
           "--eval.interval=0", "--eval.steps=1", "--model.dim=64", "--model.n_layers=2",
           "--training.seq_len=128"]  # (a small shape: what is counted does not depend on it)
    for extra in (["--training.steps=1"], ["--training.steps=2", "--checkpoint.resume=true"]):
        proc = subprocess.run([sys.executable, "-c", count, *run, *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        want = "calls: [('load_tokenizer', 1), ('model_args', 1), ('prepare_plan', 1)]\n"
        assert want in proc.stdout, proc.stdout[-2000:]
    once = "calls: [('model_args', 1)]\n"
    for command, want in ((["eval", "--checkpoint", str(tmp_path / "run"), f"--data.cache_dir={data_cache}"],
                           "calls: [('load_tokenizer', 1), ('model_args', 1), ('prepare_plan', 1)]\n"),
                          (["estimate", "--config", "configs/debug.toml", "--nproc", "4"], once),
                          (["plan", "--config", "configs/debug.toml", "--nproc", "8", "--out",
                            str(tmp_path / "plan.toml")], once)):
        proc = subprocess.run([sys.executable, "-c", count, *command], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert want in proc.stdout, (command, proc.stdout[-2000:])


def test_tp_rounding_is_checked_as_the_tp_it_emulates():
    """debug.tp_rounding (verify's TP noise floor) runs on one rank without tp, for a model that
    tensor parallel over that many ranks could split; it takes the loss TP would take (plain, not
    the fused one-rank loss)."""
    from shardwise.resolve.run import resolve_run

    base = ["--run.device=cpu", "--model.n_heads=4", "--model.n_kv_heads=2"]
    run = resolve_run(load_config(None, [*base, "--debug.tp_rounding=2"]), 1)
    assert run.loss_chunk == 0 and resolve_run(load_config(None, base), 1).loss_chunk > 0
    for args, world, fragment in (
            (["--debug.tp_rounding=2"], 2, "debug.tp_rounding=2 emulates tensor parallel's rounding on one "
                                           "rank, not on 2 ranks with tp=1"),
            (["--debug.tp_rounding=4"], 1, "debug.tp_rounding=4: parallel.tp=4 must divide model.n_heads=4 "
                                           "and model.n_kv_heads=2"),
            (["--debug.tp_rounding=-1"], 1, "debug.tp_rounding must be >= 0")):
        with pytest.raises(ConfigError, match=fragment):
            resolve_run(load_config(None, [*base, *args]), world)
