"""`shardwise eval`: a checkpoint's loss and perplexity on data prepared as training prepares it,
equal to the trainer's own validation loss of the same step, on one rank and on two (tensor
parallel); other data by --data.path; an eval set too small for one batch refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

from shardwise.cli import main
from tests.conftest import TINY_ARGS, metrics, run_cli


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
