"""``shardwise eval``: loss and perplexity of a checkpoint on a data set (or lm-eval tasks)."""

from __future__ import annotations

import argparse

from shardwise.commands.common import add_nproc, add_overwrite, add_skip_checksums
from shardwise.config import schema as config

NAME = "eval"
SUMMARY = "loss and perplexity of a checkpoint on a data set"
DESCRIPTION = (
    "Score a checkpoint: its mean token loss and perplexity over every whole global batch of a data "
    "set, prepared as training prepares it (the run's config.toml, or --config, with "
    "--section.key=value overrides: --data.path FILE_OR_FOLDER scores other data). Any layout "
    "(--parallel.*) on --nproc ranks or under torchrun."
)
EXAMPLES = (
    "shardwise eval --checkpoint runs/debug",
    "shardwise eval --checkpoint runs/debug --data.path other.txt --nproc 2",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a step-<N> checkpoint, or a run directory (its "
                   "latest one)")
    p.add_argument("--config", help="TOML for the data, batch and layout (default: the run's config.toml)")
    p.add_argument("--split", default="auto", choices=["auto", "val", "all"],
                   help="held-out part (val) or all of each source; auto: val of the run's own data, "
                        "all of data named by --data.path / --data.sources")
    add_nproc(p, "local ranks to score on (not under torchrun, which sets them)")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--out", default="", metavar="FILE", help="also write the scores as JSON to this file")
    p.add_argument("--tasks", default="", help="comma-separated lm-evaluation-harness tasks to score instead "
                   "(on --nproc ranks, batched: --batch-size; needs pip install 'shardwise[eval]')")
    p.add_argument("--tasks-path", default="", help="a folder of task YAML files for --tasks (local data)")
    p.add_argument("--limit", type=int, default=None, help="--tasks: at most this many examples per task")
    p.add_argument("--num-fewshot", type=int, default=None, help="--tasks: few-shot examples per prompt")
    p.add_argument("--batch-size", type=int, default=16, help="--tasks: log-likelihood requests per forward "
                   "pass (longest first)")
    add_skip_checksums(p)
    add_overwrite(p, "--out")


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    config.read_config(None, overrides)  # the base config is the run's: the overrides' keys and types now
    from shardwise.infer.eval_command import eval_command

    return eval_command(args, overrides, argv, args.entry)
