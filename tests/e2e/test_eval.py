"""`shardwise eval`: a checkpoint's loss and perplexity on data prepared as training prepares it,
equal to the trainer's own validation loss of the same step, on one rank and on two (tensor
parallel); other data by --data.path; an eval set too small for one batch refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardwise.cli import main
from tests.helpers import TINY_ARGS, metrics, require, run_cli


def test_eval_scores_a_checkpoint_as_training_does(tmp_path: Path, data_cache: str, capsys):
    run_dir = tmp_path / "run"
    # every held-out batch at the last step: the trainer's val_loss is the whole split's
    run_cli(["train", *TINY_ARGS, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
             "--training.steps=4", "--eval.interval=4", "--eval.steps=100000", "--checkpoint.final=true",
             "--data.document_mask=false"])
    val = metrics(run_dir)[-1]["val_loss"]
    for extra in ([], ["--nproc", "2", "--parallel.tp=2"]):
        out = run_cli(["eval", "--checkpoint", str(run_dir), "--json", f"--data.cache_dir={data_cache}",
                       *extra]).stdout
        scores = json.loads(out)["scores"]
        assert scores[-1]["name"] == "all" and abs(scores[-1]["loss"] - val) < 1e-5, (scores, val)
        assert abs(scores[-1]["perplexity"] - math.exp(val)) / math.exp(val) < 1e-4
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"And the evening and the morning were day {i}."}) + "\n"
                             for i in range(300)))
    code = main(["eval", "--checkpoint", str(run_dir), f"--data.cache_dir={data_cache}",
                 f"--data.path={other}"])
    out = capsys.readouterr().out
    assert code == 0 and "on all data" in out and "  other: loss " in out
    code = main(["eval", "--checkpoint", str(run_dir), f"--data.cache_dir={data_cache}",
                 f"--data.path={other}", "--training.global_batch=4096"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "fewer than one global batch (4096)" in err
    code = main(["eval", "--checkpoint", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err


MC = [("In the beginning God created the heaven and the", ["earth.", "sea.", "night."]),
      ("And God said, Let there be", ["light.", "bread.", "horses."]),
      ("The LORD is my shepherd; I shall not", ["want.", "run.", "sing."])]
TEXTS = ["And the evening and the morning were the first day.",
         "Blessed are the meek: for they shall inherit the earth."]


def _tasks(folder: Path) -> None:
    """Two lm-eval tasks as local files: multiple choice, and a text's rolling log-likelihood."""
    folder.mkdir()
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n"
                                             for q, c in MC))
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (folder / "kjv_mc.yaml").write_text(
        "task: kjv_mc\n" + data.format(folder / "mc.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "kjv_text.yaml").write_text(
        "task: kjv_text\n" + data.format(folder / "text.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")


@pytest.mark.slow  # (make test-all: make test keeps within its time on 2 cores)
def test_lm_eval_scores_a_checkpoint_as_its_hf_backend_scores_the_export(tmp_path: Path, data_cache: str,
                                                                        monkeypatch, capsys):
    """The adapter's log-likelihoods (continuations, whole texts) equal lm-eval's own Hugging Face
    backend's on the exported folder of the same checkpoint, and `eval --tasks` on local task files
    reports the metrics that backend reports."""
    lm_eval = require("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from shardwise.infer.generate import load_for_generation
    from shardwise.infer.harness import _adapter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run_dir, hf_dir, tasks = tmp_path / "run", tmp_path / "hf", tmp_path / "tasks"
    run_cli(["train", *TINY_ARGS, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
             "--training.steps=3", "--checkpoint.final=true"])
    run_cli(["convert", "--to-hf", str(run_dir / "checkpoints" / "step-3"), "--out", str(hf_dir),
             "--dtype", "fp32"])
    ours = _adapter(load_for_generation(checkpoint=str(run_dir), device="cpu", dtype="fp32"))
    theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=1)
    pairs = [Instance("loglikelihood", {}, (q, " " + c), 0) for q, cs in MC for c in cs]
    pairs.append(Instance("loglikelihood", {}, ("", "In the beginning"), 0))  # (an empty context)
    for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(pairs), theirs.loglikelihood(pairs),
                                            strict=True):
        assert abs(a - b) < 1e-3 and greedy_a == greedy_b, (a, b)
    texts = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in TEXTS]
    for a, b in zip(ours.loglikelihood_rolling(texts), theirs.loglikelihood_rolling(texts), strict=True):
        assert abs(a - b) < 1e-3, (a, b)
    _tasks(tasks)
    code = main(["eval", "--checkpoint", str(run_dir), "--tasks", "kjv_mc,kjv_text", "--tasks-path",
                 str(tasks), "--json"])
    assert code == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]
    want = lm_eval.simple_evaluate(model=theirs, tasks=["kjv_mc", "kjv_text"],
                                   task_manager=TaskManager(include_path=str(tasks)), bootstrap_iters=0,
                                   verbosity="ERROR")["results"]
    assert got["kjv_mc"]["acc,none"] == want["kjv_mc"]["acc,none"]
    assert abs(got["kjv_text"]["word_perplexity,none"] / want["kjv_text"]["word_perplexity,none"] - 1) < 1e-3
    code = main(["eval", "--checkpoint", str(run_dir), "--tasks", "no_such_task", "--tasks-path", str(tasks)])
    err = capsys.readouterr().err
    assert code == 2 and "lm-eval has no task no_such_task" in err.splitlines()[-1]


@pytest.mark.slow  # (make test-all: three lm-eval processes; the batching is tests/unit/test_harness.py's)
def test_lm_eval_tasks_on_two_ranks_score_as_on_one(tmp_path: Path, data_cache: str):
    """`eval --tasks --nproc 2`: each rank answers its share of the requests (batched), rank 0
    reports the same metrics as one process does."""
    require("lm_eval")
    run_dir, tasks = tmp_path / "run", tmp_path / "tasks"
    run_cli(["train", *TINY_ARGS, f"--run.dir={run_dir}", f"--data.cache_dir={data_cache}",
             "--training.steps=2", "--checkpoint.final=true"])
    _tasks(tasks)
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    ask = ["eval", "--checkpoint", str(run_dir), "--tasks", "kjv_mc,kjv_text", "--tasks-path", str(tasks),
           "--json", "--batch-size", "4"]
    one = json.loads(run_cli(ask, env=offline).stdout.strip().splitlines()[-1])["tasks"]
    two = run_cli([*ask, "--nproc", "2"], env=offline).stdout.strip().splitlines()
    assert len([line for line in two if line.startswith("{")]) == 1  # (rank 0 alone reports)
    two = json.loads(two[-1])["tasks"]
    assert one["kjv_mc"]["acc,none"] == two["kjv_mc"]["acc,none"]
    assert abs(one["kjv_text"]["word_perplexity,none"] / two["kjv_text"]["word_perplexity,none"] - 1) < 1e-6
