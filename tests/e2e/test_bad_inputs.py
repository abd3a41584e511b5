"""Bad input to every command, as a new user gives it (#59): a wrong path, a file of the wrong kind,
a bad number, an unknown name, a damaged checkpoint or HF folder, a metrics or trace file that is not
one. Each case runs the CLI in a subprocess and must exit 2 with one ``shardwise: error:`` line (no
traceback), leave every file that was there byte for byte, and create nothing outside the output
folder it names (nor in the repository)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.helpers import ROOT, TINY_ARGS, flip_byte, run_cli

pytestmark = pytest.mark.e2e

DEBUG = str(ROOT / "configs" / "debug.toml")
TINY = TINY_ARGS[2:]  # (without its --config: a case may give its own)
assert TINY_ARGS[:2] == ["--config", DEBUG]
ASSETS = ROOT / "shardwise" / "data" / "assets"
BINARY = bytes(range(256)) * 4


class Sources(NamedTuple):
    """What cases copy before damaging: a finished 2-step run and its checkpoint as an HF folder."""
    run: Path
    hf: Path
    cache: str


Setup = Callable[[Path, Sources], None]


class Case(NamedTuple):
    setup: Setup
    args: list[str]
    """``{t}`` is the case's folder, ``{cache}`` the shared token cache."""
    fragment: str
    """What the one error line must hold."""
    out: str = ""
    """The one path under ``{t}`` the command may create (its run or output folder), if any."""


# ---------------------------------------------------------------------------------------------
# Setups: each writes files into the case's folder t


def nothing(t: Path, src: Sources) -> None:
    pass


def files(contents: dict[str, str | bytes]) -> Setup:
    """Files in t, by path under it (a value of "/" makes a folder)."""
    def setup(t: Path, src: Sources) -> None:
        for name, content in contents.items():
            path = t / name
            if content == "/":
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def both(*setups: Setup) -> Setup:
    def setup(t: Path, src: Sources) -> None:
        for s in setups:
            s(t, src)
    return setup


def ckpt(damage: Callable[[Path], None] | None = None) -> Setup:
    """The run's step-2 checkpoint copied to t/step-2, then damaged."""
    def setup(t: Path, src: Sources) -> None:
        shutil.copytree(src.run / "checkpoints" / "step-2", t / "step-2")
        if damage:
            damage(t / "step-2")
    return setup


def run_copy(t: Path, src: Sources) -> None:
    """The whole finished run, at t/run."""
    shutil.copytree(src.run, t / "run")


def hf(damage: Callable[[Path], None] | None = None) -> Setup:
    """The exported HF folder (with its tokenizer) copied to t/hf, then damaged."""
    def setup(t: Path, src: Sources) -> None:
        shutil.copytree(src.hf, t / "hf")
        if damage:
            damage(t / "hf")
    return setup


def future_model_field(c: Path) -> None:
    """The manifest of a newer shardwise: a model field this one does not know."""
    manifest = json.loads((c / "manifest.json").read_text())
    manifest["model"]["future_field"] = 1
    (c / "manifest.json").write_text(json.dumps(manifest))


def unlink(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def tokenizer_folder(config: str) -> Setup:
    """t/tok: the shipped tokenizer.json beside a tokenizer_config.json holding ``config``."""
    def setup(t: Path, src: Sources) -> None:
        (t / "tok").mkdir()
        shutil.copy(ASSETS / "tokenizer.json", t / "tok" / "tokenizer.json")
        (t / "tok" / "tokenizer_config.json").write_text(config)
    return setup


def metrics_rows(*rows: str) -> Setup:
    """t/run: a run folder whose metrics.jsonl holds ``rows``."""
    return files({"run/metrics.jsonl": "".join(r + "\n" for r in rows)})


TRACE_HEADER = json.dumps({"trace": 1, "rank": 0}) + "\n"
"""The first line of a trace (observe/trace.py), then one line per step:"""
STEP_ROW = json.dumps({"step": 1, "outputs": [], "grads": []}) + "\n"
NO_STEP_ROW = json.dumps({"outputs": [], "grads": []}) + "\n"


# ---------------------------------------------------------------------------------------------
# The commands' usual arguments

def train(*extra: str, config: str = DEBUG) -> list[str]:
    return ["train", "--config", config, *TINY, "--data.cache_dir={cache}", "--run.dir={t}/run", *extra]


PLAN = ["plan", "--config", DEBUG, "--nproc", "4", "--hardware", "h100"]
ESTIMATE = ["estimate", "--config", DEBUG, "--nproc", "2", "--hardware", "h100"]
VERIFY = ["verify", "--config", DEBUG, "--steps", "1", "--data.cache_dir={cache}"]
PREPARE = ["prepare", "--config", DEBUG, "--data.prepared_dir={t}/prepared"]
PROMPT = ["--prompt", "In the beginning", "--max-new-tokens", "4", "--device", "cpu"]
GENERATE = ["generate", "--checkpoint", "{t}/step-2", *PROMPT]
GENERATE_HF = ["generate", "--hf", "{t}/hf", *PROMPT]
EVAL = ["eval", "--checkpoint", "{t}/step-2", "--data.cache_dir={cache}"]
TO_HF = ["convert", "--to-hf", "{t}/step-2", "--out"]
FROM_HF = ["convert", "--from-hf", "{t}/hf", "--out", "{t}/ck"]
REPORT = ["report", "{t}/run", "--out", "{t}/rep"]
COMPARE = ["compare", "{t}/a.trace", "{t}/b.trace"]
NOTES = files({"notes.txt": "mine"})
"""A user's file where a folder is expected."""
TRACES = files({"a.trace": TRACE_HEADER, "b.trace": TRACE_HEADER})


CASES: dict[str, Case] = {
    # train
    "train_config_is_a_folder":
        Case(files({"configs": "/"}), train(config="{t}/configs"), "is a directory", "run"),
    "train_config_is_binary": Case(files({"my.toml": BINARY}), train(config="{t}/my.toml"), "my.toml", "run"),
    "train_config_section_not_a_table":
        Case(files({"my.toml": "model = 3\n"}), train(config="{t}/my.toml"), "'model' must be a [section]",
             "run"),
    "train_unknown_preset": Case(nothing, train("--model", "llama-9b"), "'llama-9b' is not a preset", "run"),
    "train_zero_steps": Case(nothing, train("--training.steps=0"), "training.steps must be > 0", "run"),
    "train_mlflow_a_bare_folder":
        Case(nothing, train("--metrics.mlflow={t}/mlruns"), "give a tracking URI: sqlite:///", "run"),
    "train_mlflow_no_server": Case(nothing, train("--metrics.mlflow=http://127.0.0.1:9"),
                                   "no MLflow server answers there", "run"),
    "train_nproc_not_a_number": Case(nothing, train("--nproc", "two"), "--nproc", "run"),
    "train_checkpoint_is_a_file": Case(NOTES, train("--checkpoint.path={t}/notes.txt"), "is a file", "run"),
    "train_ckpt_manifest_future_field":
        Case(ckpt(future_model_field), train("--checkpoint.path={t}/step-2"), "future_field", "run"),
    "train_ckpt_manifest_is_a_list":
        Case(ckpt(write("manifest.json", "[]")), train("--checkpoint.path={t}/step-2"), "manifest.json",
             "run"),
    "train_run_dir_is_a_file": Case(NOTES, train("--run.dir={t}/notes.txt"), "notes.txt"),
    "train_into_a_finished_run": Case(run_copy, train("--run.dir={t}/run"), "run.overwrite"),
    "train_tokenizer_config_is_a_list":
        Case(tokenizer_folder("[]"), train("--data.tokenizer={t}/tok"), "tokenizer_config.json", "run"),
    "train_data_folder_is_empty":
        Case(files({"corpus": "/"}), train("--data.path={t}/corpus"), "corpus", "run"),
    "train_data_is_binary":
        Case(files({"corpus.bin": BINARY}), train("--data.path={t}/corpus.bin"), "corpus.bin", "run"),
    "train_lora_negative_rank": Case(nothing, train("--lora.rank=-1"), "lora.rank must be >= 0", "run"),
    "train_lora_target_names_no_linear": Case(nothing, train("--lora.rank=4", "--lora.targets=wq,q_proj"),
                                              "'q_proj' names no linear of this model", "run"),
    "train_initial_adapter_missing": Case(nothing, train("--checkpoint.initial_adapter={t}/none"),
                                          "is not a folder", "run"),
    "train_initial_adapter_dora": Case(files({"ad/adapter_config.json": json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True}),
        "ad/adapter_model.safetensors": "x"}), train("--checkpoint.initial_adapter={t}/ad"),
        "use_dora=True, which shardwise's LoRA does not compute", "run"),
    "train_lora_on_the_head": Case(nothing, train("--lora.rank=4", "--lora.targets=wq,output"),
                                   "the output head ('output') takes no adapter yet", "run"),
    "train_lora_resumes_a_full_run": Case(ckpt(), train("--checkpoint.path={t}/step-2", "--lora.rank=4",
                                                        "--checkpoint.resume=true"),
                                          "trained every weight (no LoRA adapters)", "run"),
    # prepare
    "prepare_data_missing":
        Case(nothing, [*PREPARE, "--data.path={t}/corpus.jsonl"], "does not exist", "prepared"),
    "prepare_rows_are_lists":
        Case(files({"c.jsonl": "[1, 2]\n[3]\n"}), [*PREPARE, "--data.path={t}/c.jsonl"], "row 1", "prepared"),
    "prepare_rows_without_text": Case(files({"c.jsonl": '{"content": "In the beginning"}\n'}),
                                      [*PREPARE, "--data.path={t}/c.jsonl"], "'text'", "prepared"),
    "prepare_dir_is_a_file":
        Case(NOTES, [*PREPARE, "--data.prepared_dir={t}/notes.txt"], "data.prepared_dir"),
    "prepare_negative_workers": Case(nothing, [*PREPARE, "--data.workers=-2"], "data.workers", "prepared"),
    "estimate_lora": Case(nothing, [*ESTIMATE, "--lora.rank=8"], "(lora.rank=8) is not costed yet"),
    # plan
    "plan_verify_one_rank": Case(nothing, ["plan", "--config", DEBUG, "--nproc", "1", "--hardware", "h100",
                                           "--verify", "--out", "{t}/plan.toml"], "--verify trains"),
    "plan_out_is_a_folder": Case(files({"plans": "/"}), [*PLAN, "--out", "{t}/plans"], "--out"),
    "plan_out_under_a_file": Case(NOTES, [*PLAN, "--out", "{t}/notes.txt/plan.toml"], "--out"),
    "plan_top_zero": Case(nothing, [*PLAN, "--top", "0", "--out", "{t}/plan.toml"], "--top must be >= 1",
                          "plan.toml"),
    "plan_memory_fraction_above_one":
        Case(nothing, [*PLAN, "--memory-fraction", "1.5", "--out", "{t}/plan.toml"], "--memory-fraction",
             "plan.toml"),
    "plan_unknown_schedule":
        Case(nothing, [*PLAN, "--schedules", "1f1c", "--out", "{t}/plan.toml"], "1f1c", "plan.toml"),
    "plan_hardware_file_is_binary":
        Case(files({"hw.toml": BINARY}), [*PLAN, "--hardware", "{t}/hw.toml", "--out", "{t}/plan.toml"],
             "hw.toml", "plan.toml"),
    "plan_without_nproc": Case(nothing, ["plan", "--config", DEBUG, "--out", "{t}/plan.toml"], "--nproc",
                               "plan.toml"),
    # estimate
    "estimate_json_under_a_file": Case(NOTES, [*ESTIMATE, "--json", "{t}/notes.txt/e.json"], "--json"),
    "estimate_json_is_a_folder": Case(files({"out": "/"}), [*ESTIMATE, "--json", "{t}/out"], "--json"),
    "estimate_unknown_model":
        Case(nothing, ["estimate", "--model", "9b", "--nproc", "8"], "'9b' is not a preset"),
    "estimate_hardware_missing_fields":
        Case(files({"hw.toml": 'name = "mine"\n'}), [*ESTIMATE, "--hardware", "{t}/hw.toml"], "memory_gib"),
    "estimate_config_is_json":
        Case(files({"cfg.json": "[]"}), ["estimate", "--config", "{t}/cfg.json", "--nproc", "2"], "cfg.json"),
    # verify
    "verify_unknown_degree":
        Case(nothing, [*VERIFY, "--out", "{t}/v", "--layouts", "dp_shrad=2"], "dp_shrad", "v"),
    "verify_degree_not_a_number":
        Case(nothing, [*VERIFY, "--out", "{t}/v", "--layouts", "tp=two"], "tp=two", "v"),
    "verify_degree_zero": Case(nothing, [*VERIFY, "--out", "{t}/v", "--layouts", "tp=0"], "tp=0", "v"),
    "verify_out_is_a_file":
        Case(NOTES, [*VERIFY, "--out", "{t}/notes.txt", "--layouts", "dp_shard=2"], "--out"),
    # generate
    "generate_checkpoint_is_a_file":
        Case(NOTES, ["generate", "--checkpoint", "{t}/notes.txt", *PROMPT], "notes.txt"),
    "generate_shard_missing": Case(ckpt(unlink("__0_0.distcp")), GENERATE, "__0_0.distcp"),
    "generate_manifest_not_json":
        Case(ckpt(write("manifest.json", "\x00\xff" * 64)), GENERATE, "manifest.json"),
    "generate_hf_config_is_a_list":
        Case(hf(write("config.json", "[1, 2]")), GENERATE_HF, "holds a JSON list"),
    "generate_tokenizer_config_is_a_list":
        Case(hf(write("tokenizer_config.json", "[]")), GENERATE_HF, "tokenizer_config.json"),
    "generate_messages_missing": Case(hf(), ["generate", "--hf", "{t}/hf", "--messages", "{t}/chat.json"],
                                      "chat.json"),
    "generate_messages_binary":
        Case(both(hf(), files({"chat.json": BINARY})),
             ["generate", "--hf", "{t}/hf", "--messages", "{t}/chat.json"], "chat.json"),
    "generate_negative_max_new_tokens":
        Case(hf(), [*GENERATE_HF, "--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
    "generate_unknown_dtype": Case(hf(), [*GENERATE_HF, "--dtype", "fp16"], "--dtype"),
    "generate_tokenizer_is_binary":
        Case(both(hf(), files({"tok.json": BINARY})), [*GENERATE_HF, "--tokenizer", "{t}/tok.json"],
             "tok.json"),
    # eval
    "eval_unknown_task":
        Case(ckpt(), ["eval", "--checkpoint", "{t}/step-2", "--tasks", "no_such_task"], "no_such_task"),
    "eval_tasks_path_missing":
        Case(ckpt(), ["eval", "--checkpoint", "{t}/step-2", "--tasks", "mine", "--tasks-path", "{t}/tasks"],
             "does not exist"),
    "eval_checkpoint_without_manifest": Case(ckpt(unlink("manifest.json")), EVAL, "manifest.json"),
    "eval_flipped_byte": Case(ckpt(flip_byte), EVAL, "does not match its SHA-256"),
    "eval_manifest_future_field": Case(ckpt(future_model_field), EVAL, "future_field"),
    "eval_run_without_checkpoints":
        Case(files({"run/config.toml": "[training]\nsteps = 2\n"}),
             ["eval", "--checkpoint", "{t}/run", "--data.cache_dir={cache}"], "checkpoint"),
    # convert
    "convert_to_hf_out_not_empty":
        Case(both(ckpt(), files({"hf_out/notes.txt": "mine"})), [*TO_HF, "{t}/hf_out"],
             "the folder holds files"),
    "convert_to_hf_out_is_a_file": Case(both(ckpt(), NOTES), [*TO_HF, "{t}/notes.txt"], "--out"),
    "generate_adapter_on_a_checkpoint": Case(both(ckpt(), files({"ad": "/"})),
                                             [*GENERATE, "--adapter", "{t}/ad"],
                                             "a LoRA checkpoint holds its own adapters"),
    "convert_adapter_of_a_full_run": Case(ckpt(), [*TO_HF, "{t}/adapter", "--adapter"],
                                          "holds no LoRA adapters (it trained every weight)", "adapter"),
    "convert_to_hf_without_metadata": Case(ckpt(unlink(".metadata")), [*TO_HF, "{t}/hf_out"], ".metadata",
                                           "hf_out"),
    "convert_from_hf_config_is_a_list":
        Case(hf(write("config.json", "[1, 2]")), FROM_HF, "holds a JSON list", "ck"),
    "convert_from_hf_without_weights": Case(hf(unlink("model.safetensors")), FROM_HF, "safetensors", "ck"),
    "convert_from_hf_is_a_file":
        Case(NOTES, ["convert", "--from-hf", "{t}/notes.txt", "--out", "{t}/ck"], "notes.txt", "ck"),
    "convert_toml_under_a_file":
        Case(both(hf(), NOTES), [*FROM_HF, "--toml", "{t}/notes.txt/ck.toml"], "--toml", "ck"),
    # report
    "report_row_without_step": Case(metrics_rows('{"loss": 2.5}'), REPORT, "'step'", "rep"),
    "report_metrics_binary": Case(files({"run/metrics.jsonl": BINARY}), REPORT, "metrics.jsonl", "rep"),
    "report_row_is_a_list": Case(metrics_rows("[1, 2.5]"), REPORT, "metrics.jsonl", "rep"),
    "report_metrics_empty": Case(metrics_rows(), REPORT, "metrics.jsonl", "rep"),
    "report_out_under_a_file":
        Case(both(run_copy, NOTES), ["report", "{t}/run", "--out", "{t}/notes.txt/rep"], "--out"),
    "report_run_is_a_file":
        Case(NOTES, ["report", "{t}/notes.txt", "--out", "{t}/rep"], "has no metrics.jsonl", "rep"),
    # compare
    "compare_metrics_for_traces":
        Case(run_copy, ["compare", "{t}/run/metrics.jsonl", "{t}/run/metrics.jsonl"],
             "is not a shardwise trace"),
    "compare_trace_is_a_folder":
        Case(files({"a.trace": "/", "b.trace": TRACE_HEADER}), COMPARE, "is a folder, not a trace file"),
    "compare_binary_trace": Case(files({"a.trace": BINARY, "b.trace": TRACE_HEADER}), COMPARE, "a.trace"),
    "compare_row_without_step":
        Case(files({"a.trace": TRACE_HEADER + NO_STEP_ROW, "b.trace": TRACE_HEADER + STEP_ROW}), COMPARE,
             "'step'"),
    "compare_empty_trace": Case(files({"a.trace": "", "b.trace": TRACE_HEADER}), COMPARE, "a.trace"),
    "compare_rtol_not_a_number": Case(TRACES, [*COMPARE, "--rtol", "tiny"], "--rtol"),
}


# ---------------------------------------------------------------------------------------------
# Fixtures and the test


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Sources:
    """A finished 2-step run with its final checkpoint (step-2), and that checkpoint as an HF folder."""
    run_dir = tmp_path_factory.mktemp("saved")
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
             "--training.steps=2", "--lr_scheduler.warmup_steps=1", "--checkpoint.final=true"])
    hf_dir = tmp_path_factory.mktemp("hf") / "hf"
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-2"), "--out", str(hf_dir),
             "--dtype", "fp32"])
    return Sources(run_dir, hf_dir, data_cache)


def snapshot(*roots: Path) -> dict[str, bytes | None]:
    """Every path under ``roots``: a file's bytes, None for a folder."""
    found: dict[str, bytes | None] = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            found[str(path)] = path.read_bytes() if path.is_file() else None
    return found


SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "shardwise", "tests", "docs"}


USER_CACHE = Path("~/.cache/shardwise").expanduser()  # data.cache_dir's default


def shared_paths() -> set[str]:
    """The paths of the repository (outside the folders other work changes: source, tests, docs;
    and the tools' caches) and of the default data cache: a refused command adds none."""
    found = set()
    for root in (ROOT, USER_CACHE):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not (root == ROOT and d in SKIP or d.endswith(".egg-info"))]
            found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_touches_nothing(name: str, sources: Sources, tmp_path: Path):
    case = CASES[name]
    t = tmp_path / "case"
    t.mkdir()
    case.setup(t, sources)
    args = [a.format(t=t, cache=sources.cache) for a in case.args]
    before, shared_before = snapshot(t, sources.run, sources.hf), shared_paths()

    proc = run_cli(args, check=False, timeout=300)

    said = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines()
             if ln.strip() and not ln.startswith(("warning:", "notice:"))]
    shown = f"exit {proc.returncode}: " + " | ".join(lines[:5] or proc.stdout.splitlines()[-3:])
    if "Traceback" in said:
        shown += " ... " + said.strip().splitlines()[-1]
    assert "Traceback" not in said, shown
    assert proc.returncode == 2 and len(lines) == 1, shown
    assert lines[0].startswith("shardwise: error:") and case.fragment in lines[0], shown
    after = snapshot(t, sources.run, sources.hf)
    changed = sorted(p for p, data in before.items() if after.get(p, b"gone") != data)
    assert not changed, f"changed or removed: {changed}"
    allowed = str(t / case.out) if case.out else None
    new = sorted(p for p in set(after) - set(before)
                 if not (allowed and (p == allowed or p.startswith(allowed + os.sep))))
    assert not new, f"written outside the case's output: {new}"
    assert shared_paths() == shared_before, "the command wrote into the repository or the default cache"
