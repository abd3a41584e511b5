"""End to end through the CLI: the README's main job on a short schedule, and bad input."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.cli import main
from shardwise.models import model_args
from shardwise.observe.flops import attention_pairs, executed_flops, flops_per_token
from shardwise.resolve.checks import load_config
from tests.helpers import (
    ROOT,
    TINY_ARGS,
    flip_byte,
    metrics,
    require,
    resolved_config,
    run_cli,
    truncate_shard,
)

pytestmark = pytest.mark.e2e
REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "exec_util", "memory_gib",
            "memory_current_gib", "memory_gib_per_rank", "step_time_s_per_rank", "straggler_ratio"}


def test_main_job_short_schedule(tmp_path: Path, data_cache: str):
    """What `make run` runs (configs/debug.toml), cut to 12 steps: the loss visibly falls (8.07 to
    5.80 over the last five steps here) and the run directory holds everything the README promises."""
    run_dir = tmp_path / "debug"
    proc = run_cli(["train", "--config", "configs/debug.toml", "--run.overwrite", "true",
                    f"--run.dir={run_dir}", "--training.steps=12", "--lr_scheduler.warmup_steps=3",
                    "--eval.interval=6", "--checkpoint.interval=6", f"--data.cache_dir={data_cache}"],
                   timeout=900)
    assert "MFU peak" in proc.stdout and "run directory" in proc.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(REQUIRED <= r.keys() for r in rows)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 7.0 and last < first - 1.5, (first, last)  # from ~ln(2048) down
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["memory_gib"] > 0 for r in rows)
    # Executed FLOPs (causal attention, flash backward 2.5x) over PaLM's, for the debug shape at 512.
    args, s = model_args(load_config(ROOT / "configs/debug.toml").model), 512  # (the recipe: QK-norm)
    ratio = executed_flops(args, s, attention_pairs(s)).total / (flops_per_token(args, s) * s)
    assert all(r["exec_util"] / r["mfu"] == pytest.approx(ratio, rel=1e-6) for r in rows)
    saved = tomllib.loads((run_dir / "config.toml").read_text())
    assert saved["training"]["steps"] == 12 and saved["model"]["dim"] == 256
    assert load_config(run_dir / "config.toml").training.steps == 12
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for step in (6, 12):
        assert (run_dir / "checkpoints" / f"step-{step}" / ".metadata").is_file()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_print_config_round_trips(tmp_path: Path):
    proc = run_cli(["train", "--config", "configs/debug.toml", "--print-config", "--training.steps=12"])
    f = tmp_path / "c.toml"
    f.write_text(proc.stdout)
    assert load_config(f) == resolved_config(ROOT / "configs/debug.toml", ["--training.steps=12"])


def test_help_config_lists_every_key():
    out = run_cli(["train", "--help-config"]).stdout
    for key in ("--training.global_batch", "--parallel.backend_override", "--checkpoint.resume"):
        assert key in out


def test_a_benchmark_shape_on_the_shipped_tokenizer_trains_with_a_notice(capsys):
    from shardwise.resolve.preflight import check_tokenizer

    cfg = resolved_config(None, ["--model.name=125m"], device="cpu")
    check_tokenizer(cfg, model_args(cfg.model), 2048)
    assert ("notice: model 125m has 32,000 embedding rows and the shipped tokenizer 2,048 ids: the rows "
            "beyond are never trained") in capsys.readouterr().out
    check_tokenizer(cfg, model_args(cfg.model), 31_800)  # within padding: nothing to say
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("args,fragment", [
    (["--training.stpes=3"], "did you mean 'training.steps'"),
    (["--training.steps=abc"], "expects int"),
    (["--nproc=3", "--parallel.dp_shard=2"], "!= world size 3"),
    (["--nproc=4", "--parallel.dp_replicate=3"], "world size 4 is not divisible"),
    (["--parallel.cp=2", "--nproc=2", "--data.document_mask=false", "--training.seq_len=66"],
     "divisible by 2*cp=4"),
    (["--parallel.pp=2", "--nproc=2", "--data.document_mask=false", "--training.micro_batch=8"],
     "1f1b needs at least pp=2 micro-batches"),
    (["--parallel.pp=4", "--nproc=4", "--data.document_mask=false", "--model.n_layers=4",
      "--training.global_batch=2"], "1f1b needs at least pp=4 micro-batches per step, got 2"),
    (["--parallel.pp=2", "--nproc=2", "--parallel.pp_schedule=dualpipev", "--data.document_mask=false",
      "--model.n_layers=4", "--training.micro_batch=4"],
     "pp_schedule=dualpipev needs at least 2*pp=4 micro-batches"),
    (["--parallel.pp=2", "--nproc=2", "--parallel.pp_schedule=zbv"],
     "pp_schedule=zbv needs pp*stages_per_rank=4"),
    (["--parallel.pp=2", "--nproc=2", "--data.document_mask=false", "--parallel.pp_schedule=interleaved1f1b"],
     "needs pp*stages_per_rank=4 stages of at least one block, but model.n_layers=2"),
    (["--parallel.tp=2", "--nproc=2", "--model.n_kv_heads=1"], "parallel.tp=2 must divide"),
    (["--parallel.ep=2", "--nproc=2"], "parallel.ep=2 needs an MoE model"),
    (["--parallel.pp=2", "--nproc=2", "--training.loss_chunk=128", "--data.document_mask=false",
      "--parallel.pp_schedule=gpipe"],
     "training.loss_chunk with parallel.pp > 1"),
    (["--parallel.pp=2", "--nproc=2", "--training.loss=fused", "--data.document_mask=false",
      "--parallel.pp_schedule=gpipe"],
     "training.loss=fused with parallel.pp > 1"),
    (["--training.loss=plain", "--training.loss_chunk=64"],
     "training.loss_chunk=64 is the fused loss's chunk"),
    (["--parallel.async_tp=true"], "parallel.async_tp needs parallel.tp > 1"),
    (["--parallel.async_tp=true", "--parallel.tp=2", "--nproc=2"],
     "parallel.async_tp needs CUDA GPUs and NCCL (symmetric memory); this run is cpu/auto"),
    (["--compile.enabled=maybe"], "compile.enabled must be one of auto, true, false"),
    (["--float8.enabled=true", "--float8.recipe=rowwise", "--float8.fsdp_all_gather=true"],
     "float8.recipe=rowwise has no float8 FSDP all-gather"),
    (["--float8.recipe=blockwise"], "float8.recipe must be one of tensorwise, rowwise"),
    (["--activation_checkpoint.mode=some"], "activation_checkpoint.mode must be one of"),
    (["--optimizer.state_dtype=fp16"], "optimizer.state_dtype must be one of fp32, bf16"),
    (["--model.name=moe-debug", "--model.moe_top_k=9"], "model.moe_top_k=9 must be between 1 and"),
    (["--model.name=moe-debug", "--model.moe_balance=loss"], "model.moe_balance"),
    (["--training.global_batch=6", "--nproc=4"], "global_batch=6 must be divisible"),
    (["--training.micro_batch=3"], "training.micro_batch=3 must divide"),
    (["--data.path=/nonexistent/corpus.jsonl"], "data.path '/nonexistent/corpus.jsonl' does not exist"),
    (["--data.tokenizer=byte", "--model.vocab_size=100"], "the tokenizer has 258 tokens"),
    # a family's model on a tokenizer far smaller than its vocabulary (beyond padding), and an
    # imported (custom) one: refused; the 125m benchmark shape trains with a notice (below)
    (["--model.name=qwen3-0.6b"], "model qwen3-0.6b has a vocabulary of 151,936 but data.tokenizer (the "
     "shipped tokenizer) has 2,048 tokens: train it with its Qwen3 tokenizer, --data.tokenizer DIR"),
    (["--model.name=", "--model.vocab_size=32000"], "model custom has a vocabulary of 32,000 but"),
    (["--checkpoint.path=/nonexistent/step-3"], "checkpoint.path '/nonexistent/step-3' does not exist"),
    (["--config=/nonexistent.toml"], "config file '/nonexistent.toml' does not exist"),
    (["--foo.bar=1"], "unknown config key 'foo.bar'"),
    (["--training.steps"], "override '--training.steps' has no value"),
    (["--training.seq_len=4096"], "training.seq_len=4096 exceeds model.max_seq_len"),
    (["--optimizer.lr=-1"], "optimizer.lr must be >= 0"),
    (["--checkpoint.keep_latest_k=-1"], "checkpoint.keep_latest_k must be >= 0"),
    (["--checkpoint.async_mode=fork"], "checkpoint.async_mode must be one of none, thread, process"),
    (["--training.nonfinite=ignore"], "training.nonfinite must be one of stop, skip"),
    (["--nproc=0"], "--nproc must be >= 1"),
])
def test_bad_input_exits_2_with_one_line(args: list[str], fragment: str, tmp_path: Path, capsys):
    # In-process: these are all refused before any process group or file exists (the cases below
    # and test_bad_files_exit_2_with_one_line go through a real subprocess).
    code = main(["train", *TINY_ARGS, f"--run.dir={tmp_path / 'r'}", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error:") and fragment in lines[0], lines
    assert not (tmp_path / "r").exists()  # rejected before any work or process group
    assert not dist.is_initialized()


def test_missing_wandb_is_one_line_before_any_work(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    code = main(["train", *TINY_ARGS, f"--run.dir={tmp_path / 'r'}", "--metrics.wandb=true"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "metrics.wandb=true needs the wandb package" in lines[0]
    assert not (tmp_path / "r").exists()


def test_bad_input_subprocess_exit_code(tmp_path: Path):
    proc = run_cli(["train", *TINY_ARGS, f"--run.dir={tmp_path / 'r'}", "--nproc=3",
                    "--parallel.dp_shard=2"], check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "!= world size 3" in proc.stderr


def test_more_ranks_than_gpus_is_one_line_before_any_rank(tmp_path: Path):
    """On a machine with one GPU (faked: torch reports one CUDA device), ``--nproc 2`` is refused
    before the ranks start; on an H200 it was a CUDA traceback from rank 1's ``set_device``."""
    proc = run_cli(["train", *TINY_ARGS, f"--run.dir={tmp_path / 'r'}", "--run.device=cuda", "--nproc=2"],
                   check=False, fault="one_gpu")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "2 ranks on this machine but 1 CUDA device(s) visible" in proc.stderr
    assert "use --nproc 1" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    """A finished 2-step run with its final checkpoint (step-2)."""
    run_dir = tmp_path_factory.mktemp("saved")
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
             "--training.steps=2", "--lr_scheduler.warmup_steps=1", "--checkpoint.final=true"])
    return run_dir


def _bad_vocab_tokenizer(tmp: Path) -> str:
    """A tokenizer whose ids reach past the model's vocabulary (id 5000 > vocab 2048)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "the": 5000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    path = tmp / "tok.json"
    tok.save(str(path))
    return str(path)


# Each: how to damage a copy of a good checkpoint (or write bad data), the args, the message.
# "early" errors come before any process group or file is made; "late" ones need the ranks (a
# checksum over the files, rows parsed while the data is prepared) and come before the first step.
BAD_FILES = {
    "ckpt_no_manifest": (lambda c, t: (c / "manifest.json").unlink(), "ckpt",
                         "is incomplete (no manifest.json", "early"),
    "ckpt_truncated": (lambda c, t: truncate_shard(c), "ckpt", "is truncated or altered", "early"),
    "ckpt_other_shape": (lambda c, t: None, "ckpt --model.dim=128 --model.n_heads=8",
                         "parameter 'tok_embeddings.weight' has shape (2048, 64) there but (2048, 128) "
                         "in this model", "early"),
    "ckpt_bad_manifest": (lambda c, t: (c / "manifest.json").write_text("{"), "ckpt",
                          "unreadable manifest.json", "early"),
    "run_dir_under_a_file": (lambda c, t: (t / "file").write_text("x"), "--run.dir={t}/file/run",
                             "cannot be created", "early"),
    "empty_data_file": (lambda c, t: (t / "empty.txt").write_text(""), "--data.path={t}/empty.txt",
                        "is empty", "early"),
    "ckpt_tampered": (lambda c, t: flip_byte(c), "ckpt", "does not match its SHA-256", "late"),
    "corrupt_jsonl": (lambda c, t: (t / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n'),
                      "--data.path={t}/bad.jsonl", "bad.jsonl' row 2: not valid JSON", "late"),
    "token_beyond_vocab": (lambda c, t: None, "--data.tokenizer={tok}",
                           "the tokenizer has 5001 tokens but model.vocab_size=2048", "early"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_exit_2_with_one_line(case: str, saved_run: Path, tmp_path: Path, data_cache: str, capsys):
    """Late cases go through a real subprocess (the ranks' one line and exit 2); early ones are refused
    before any process group, in-process as test_bad_input_exits_2_with_one_line (a subprocess pays
    4 s of imports for each)."""
    damage, args, fragment, when = BAD_FILES[case]
    ckpt = tmp_path / "step-2"
    shutil.copytree(saved_run / "checkpoints" / "step-2", ckpt)
    damage(ckpt, tmp_path)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    extra = (args.replace("ckpt", f"--checkpoint.path={ckpt}", 1) if args.startswith("ckpt")
             else args.format(t=tmp_path, tok=_bad_vocab_tokenizer(tmp_path) if "{tok}" in args else ""))
    run_dir = tmp_path / "r"
    args = ["train", *TINY_ARGS, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}", *extra.split()]
    if when == "early":
        code, err = main(args), capsys.readouterr().err
        assert not dist.is_initialized()
    else:
        proc = run_cli(args, check=False, timeout=120)
        code, err = proc.returncode, proc.stderr
    assert code == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error:") and fragment in lines[0], lines
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # the checkpoint is untouched
    if when == "early":
        assert not run_dir.exists()
    else:
        assert not (run_dir / "metrics.jsonl").exists() or not metrics(run_dir)  # no step ran


def test_wandb_offline_run_is_written_and_a_resume_logs_on_into_it(tmp_path: Path, data_cache: str):
    """metrics.wandb logs the same scalars to an offline W&B run inside run.dir (no network); the
    resumed run logs under the same W&B run id."""
    require("wandb")  # a dev dependency
    common = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path}",
              "--lr_scheduler.warmup_steps=1", "--metrics.wandb=true", "--metrics.wandb_mode=offline",
              "--checkpoint.final=true"]
    run_cli([*common, "--training.steps=3"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record,) = runs[0].glob("run-*.wandb")
    data = record.read_bytes()  # W&B's binary log of the run: our metric names are in it
    assert len(data) > 1000 and b"grad_norm" in data and b"exec_util" in data and b"loss" in data
    run_id = (tmp_path / "wandb" / "shardwise-run-id").read_text().strip()
    assert runs[0].name.endswith(f"-{run_id}")
    run_cli([*common, "--training.steps=5", "--checkpoint.resume=true"])
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)  # `wandb sync` joins them


def test_mlflow_run_gets_the_logged_scalars_and_a_resume_logs_on_into_it(tmp_path: Path, data_cache: str):
    """metrics.mlflow logs every step's scalars (as metrics.jsonl has them) and the run's config to
    one MLflow run (a sqlite store, no server); the resumed run logs on into it."""
    require("mlflow")  # a dev dependency
    from mlflow.tracking import MlflowClient

    uri, run_dir = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}", tmp_path / "r"
    common = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}",
              "--lr_scheduler.warmup_steps=1", f"--metrics.mlflow={uri}", "--checkpoint.final=true"]
    (tmp_path / "cwd").mkdir()
    run_cli([*common, "--training.steps=3"], cwd=tmp_path / "cwd")
    run_cli([*common, "--training.steps=5", "--checkpoint.resume=true"], cwd=tmp_path / "cwd")
    assert list((tmp_path / "cwd").iterdir()) == []  # (MLflow's default store is not opened there)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("shardwise").experiment_id])
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert (run_dir / "mlflow-run-id").read_text().strip() == run.info.run_id
    assert run.data.params["training.steps"] == "3" and run.data.params["model.dim"] == "64"
    logged = {r["step"]: r for r in metrics(run_dir)}
    for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == pytest.approx({s: r[key] for s, r in logged.items()}), key
    assert sorted(logged) == [1, 2, 3, 4, 5]


def test_hf_folder_to_training_and_back_with_no_model_flags(tmp_path: Path, data_cache: str):
    """A Qwen3 folder that transformers made: `convert --from-hf` reads its shape from config.json and
    writes a config that trains as is; the trained checkpoint exports back to a folder transformers
    loads as Qwen3. A second import onto the same config file is refused, the file untouched."""
    transformers = require("transformers")
    hf_cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      vocab_size=2048, max_position_embeddings=128, tie_word_embeddings=True)
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(tmp_path / "qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer of the folder's own
        shutil.copy(ROOT / "shardwise" / "data" / "assets" / name, tmp_path / "qwen3" / name)
    ckpt, toml = tmp_path / "init" / "step-0", tmp_path / "init" / "step-0.toml"
    out = run_cli(["convert", "--from-hf", str(tmp_path / "qwen3"), "--out", str(ckpt)]).stdout
    assert f"train from it: shardwise train --config {toml}" in out
    written = toml.read_text()
    assert 'name = ""' in written and "qk_norm = true" in written and "ffn_hidden_size = 96" in written
    assert tomllib.loads(written)["data"]["tokenizer"] == str(tmp_path / "qwen3")  # the folder's
    # precision is left to the machine that trains (this one's choice would pin fp32 on GPUs)
    assert tomllib.loads(written)["training"]["mixed_precision"] == "auto"
    byte = tmp_path / "byte.toml"  # ... unless the command line names another
    run_cli(["convert", "--from-hf", str(tmp_path / "qwen3"), "--out", str(tmp_path / "b" / "step-0"),
             "--toml", str(byte), "--data.tokenizer", "byte"])
    assert tomllib.loads(byte.read_text())["data"]["tokenizer"] == "byte"
    run_dir = tmp_path / "run"
    run_cli(["train", "--config", str(toml), f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
             "--training.steps=2", "--training.seq_len=64", "--training.global_batch=4",
             "--eval.interval=0", "--metrics.log_format=line", "--compile.enabled=false"])
    assert len(metrics(run_dir)) >= 1
    back = tmp_path / "back"
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-2"), "--out", str(back),
             "--dtype", "fp32"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    # the folder alone is a model to chat with: the run's tokenizer, chat template and end token
    tok = transformers.AutoTokenizer.from_pretrained(back)
    assert tok.chat_template and tok.eos_token == "<|eos|>"
    assert json.loads((back / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    prompt = tok("And God said")["input_ids"]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    for source in (["--hf", str(back)], ["--checkpoint", str(run_dir)]):  # a run directory: its latest
        out = json.loads(run_cli(["generate", *source, "--prompt", "And God said", "--max-new-tokens", "12",
                                  "--dtype", "fp32", "--json"]).stdout)
        assert out["prompt_tokens"] == prompt and out["tokens"] == theirs
    again = run_cli(["convert", "--from-hf", str(tmp_path / "qwen3"), "--out", str(tmp_path / "x"),
                     "--toml", str(toml)], check=False)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "pass --overwrite" in again.stderr
    assert toml.read_text() == written


def test_fine_tuning_on_chat_data_lowers_the_assistant_loss(tmp_path: Path, data_cache: str):
    """configs/chat-debug.toml: the shipped chat set, the loss on assistant tokens only (test_chat.py
    checks the counting); the training and held-out assistant-token losses fall over 20 steps of 4
    packed windows."""
    run_dir = tmp_path / "chat"
    run_cli(["train", "--config", str(ROOT / "configs" / "chat-debug.toml"), f"--run.dir={run_dir}",
             f"--data.cache_dir={data_cache}", "--training.steps=20", "--eval.interval=10",
             "--training.global_batch=4", "--metrics.log_format=line", "--compile.enabled=false",
             "--checkpoint.interval=0"])
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses
    assert len(vals) == 2 and vals[-1] < vals[0], vals


def test_epochs_set_the_steps_from_the_prepared_data(tmp_path: Path, data_cache: str):
    """training.epochs: the steps are epochs x the packed training windows / global batch, said in a
    notice, and the run takes exactly that many."""
    import math

    from shardwise.config.schema import Config
    from shardwise.data.dataset import open_corpus
    from shardwise.data.tokenizer import load_tokenizer

    chats = tmp_path / "chats.jsonl"
    verse = "In the beginning God created the heaven and the earth."
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Which verse is number {i}?"},
        {"role": "assistant", "content": verse * (1 + i % 3)}]}) + "\n" for i in range(48)))
    cfg = Config()
    cfg.data.format, cfg.data.path, cfg.data.cache_dir = "chat", str(chats), data_cache
    windows = sum(s.num_windows(128) for s in open_corpus(cfg.data, load_tokenizer("")).train)
    steps = math.ceil(1.5 * windows / 4)
    run_dir = tmp_path / "run"
    out = run_cli(["train", "--config", str(ROOT / "configs" / "chat-debug.toml"), f"--data.path={chats}",
                   f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}", "--training.epochs=1.5",
                   "--training.seq_len=128", "--training.global_batch=4", "--eval.interval=0",
                   "--checkpoint.interval=0", "--compile.enabled=false", "--metrics.log_format=line"]).stdout
    assert (f"notice: training.epochs=1.5: {windows} training windows of 128 tokens at global_batch=4 make "
            f"training.steps={steps}") in out
    assert [r["step"] for r in metrics(run_dir)][-1] == steps


def test_generate_bad_input_is_one_line(tmp_path: Path, capsys):
    """generate's refusals, in-process: a missing checkpoint, a folder that is no run, an HF folder
    without a tokenizer, a prompt longer than the context, a messages file that is not one."""
    transformers = require("transformers")
    folder = tmp_path / "hf"
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=2048,
                                   max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"role": "user"}')
    capsys.readouterr()  # (transformers' progress bar)
    cases = [(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"], "does not exist"),
             (["--checkpoint", str(tmp_path / "empty"), "--prompt", "x"], "nor a run directory"),
             (["--hf", str(folder), "--prompt", "x"], "has no tokenizer.json: pass --tokenizer"),
             (["--hf", str(folder), "--tokenizer", str(ROOT / "shardwise" / "data" / "assets"),
               "--prompt", "word " * 80], "exceeds the model's context of 64 tokens"),
             (["--hf", str(folder), "--messages", str(tmp_path / "bad.json")], "not a list of messages"),
             (["--hf", str(folder), "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]")]
    for args, fragment in cases:
        code = main(["generate", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and fragment in err, (args, err)


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--confg", "configs/debug.toml"], "unknown flag '--confg' for 'shardwise train'; did you mean "
                                                 "'--config'?"),
    (["train", "--steps", "3"], "did you mean '--training.steps' or '--eval.steps'?"),
    (["train", "--nproc-per-node", "2"], "did you mean '--nproc'?"),
    (["trian", "--config", "configs/debug.toml"], "unknown command 'trian'; did you mean 'train'?"),
])
def test_misspelt_flags_and_commands_get_the_nearest_one(argv: list[str], fragment: str, capsys):
    """One line with the nearest flag, config key or command -- before torch is imported."""
    import sys

    torch_loaded = "torch" in sys.modules
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and fragment in err, err
    if not torch_loaded:  # (in-process: only meaningful when no earlier test imported it)
        assert "torch" not in sys.modules


def test_version_a_bare_boolean_and_toml_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("shardwise ")
    assert main(["train", "--config", str(ROOT / "configs" / "debug.toml"), "--compile.enabled",
                 "--run.overwrite", "--print-config"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["compile"]["enabled"] is True and printed["run"]["overwrite"] is True
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "--run.overwrite  (bool, default false)" in out and "default False" not in out
    assert '(str, default "runs/default")' in out


def test_a_start_past_the_last_step_and_a_zero_learning_rate_are_said(tmp_path: Path, data_cache: str):
    """--checkpoint.path at step 2 with training.steps=1 would train nothing: one line, exit 2 (it
    trained nothing without a word); optimizer.lr=0 trains with a notice that nothing will change."""
    common = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", "--lr_scheduler.warmup_steps=0"]
    run_cli([*common, f"--run.dir={tmp_path / 'a'}", "--training.steps=2", "--checkpoint.final=true"])
    step2 = tmp_path / "a" / "checkpoints" / "step-2"
    past = run_cli([*common, f"--run.dir={tmp_path / 'b'}", "--training.steps=1",
                    f"--checkpoint.path={step2}"], check=False)
    assert past.returncode == 2, past.stdout + past.stderr
    lines = [ln for ln in past.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is at step 2 and training.steps=1: nothing is left to train: set " \
        "training.steps above 2" in lines[0], past.stderr
    zero = run_cli([*common, f"--run.dir={tmp_path / 'c'}", "--training.steps=1", "--optimizer.lr=0"])
    assert "notice: optimizer.lr=0: the weights will not change" in zero.stdout


def test_stop_after_trains_a_longer_runs_first_steps_and_saves_the_last(tmp_path: Path, data_cache: str):
    """training.stop_after=4 of a 10-step run: steps 1-4 exactly as the whole run's (its learning-rate
    schedule, not one compressed into 4 steps -- what verify compares layouts on), step 4 saved;
    a stop past training.steps is one line, exit 2."""
    common = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", "--lr_scheduler.warmup_steps=6"]
    run_cli([*common, f"--run.dir={tmp_path / 'whole'}"])
    run_cli([*common, f"--run.dir={tmp_path / 'first'}", "--training.stop_after=4",
             "--checkpoint.final=true"])
    whole, first = metrics(tmp_path / "whole"), metrics(tmp_path / "first")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert [(r["loss"], r["lr"]) for r in first] == [(r["loss"], r["lr"]) for r in whole[:4]]
    assert first[-1]["lr"] == pytest.approx(4 / 6 * whole[5]["lr"])  # still warming up over 6 steps
    assert [p.name for p in (tmp_path / "first" / "checkpoints").iterdir()] == ["step-4"]
    past = run_cli([*common, f"--run.dir={tmp_path / 'past'}", "--training.stop_after=11"], check=False)
    assert past.returncode == 2 and "training.stop_after=11 exceeds training.steps=10" in past.stderr
