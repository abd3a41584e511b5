"""Every command's flags, help and examples, and the checks of a command line that need nothing but
the line: the CLI (shardwise/cli.py) builds every parser before it imports torch, so ``--help``, a
misspelt flag and a config error answer at once.

One vocabulary across the commands: ``--nproc`` is the number of ranks (devices) wherever a command
needs one (``--gpus`` and ``--world``, the planner's older names, still work, with a notice);
``--model`` names a preset wherever a model can be named."""

from __future__ import annotations

import argparse
import difflib
import textwrap
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import NoReturn

from shardwise.config.notice import notice
from shardwise.config.schema import preset_toml, section_fields, sections
from shardwise.config.types import ConfigError
from shardwise.models import PRESETS

EXAMPLES: dict[str, tuple[str, ...]] = {
    "train": ("shardwise train --config configs/debug.toml",
             "shardwise train --config configs/debug.toml --nproc 4 --parallel.tp 2",
             "shardwise train --model 125m --data.path corpus/ --training.steps 1000",
             "torchrun --nproc-per-node 8 -m shardwise train --config plan.toml"),
    "prepare": ("shardwise prepare --config configs/debug.toml --data.path corpus/",),
    "plan": ("shardwise plan --model 8b --nproc 8",
            "shardwise plan --model 70b --nproc 256 --hardware h200 --global-batch-tokens 4M"),
    "estimate": ("shardwise estimate --model 8b --nproc 8 --parallel.tp 2",
                "shardwise estimate --config plan.toml --nproc 64 --json estimate.json"),
    "calibrate": ("shardwise calibrate --quick",),
    "verify": ("shardwise verify --config configs/debug.toml --nproc 4",
              "shardwise verify --config configs/debug.toml --layouts dp_shard=2 tp=2 --steps 10"),
    "compare": ("shardwise compare runs/a.trace runs/b.trace",
                "shardwise compare runs/a.trace runs/b.trace --rtol 1e-6"),
    "generate": ("shardwise generate --checkpoint runs/debug --prompt 'In the beginning'",
                 "shardwise generate --hf hf-out --prompt 'In the beginning' --temperature 0.8"),
    "eval": ("shardwise eval --checkpoint runs/debug",
            "shardwise eval --checkpoint runs/debug --data.path other.txt --nproc 2"),
    "convert": ("shardwise convert --to-hf runs/debug/checkpoints/step-100 --out hf-out",
               "shardwise convert --from-hf Qwen3-0.6B --out ckpt/qwen3"),
    "report": ("shardwise report runs/debug",
              "shardwise report runs/a runs/b --out runs/compare"),
}
"""Each command's ``--help`` ends with these, in the order a user meets the commands
(tests/e2e/test_vocabulary.py parses every one)."""
NPROC_ALIASES = ("--gpus", "--world")
"""Older spellings of ``--nproc`` (plan, estimate), accepted with a notice."""


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one to show (not None, "" or a switch's False); the description
    wrapped here and the examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors (a value of the wrong type, a choice it does not offer, a missing
    flag) raised as one line, as every other bad input is, instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def command(sub: argparse._SubParsersAction, name: str, summary: str, description: str
            ) -> argparse.ArgumentParser:
    """A subcommand's parser: its defaults in ``--help`` and its examples at the end."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES.get(name, ()))
    return sub.add_parser(name, help=summary, allow_abbrev=False, formatter_class=_Help,
                          description=textwrap.fill(description, 100), epilog=epilog)


def add_nproc(p: argparse.ArgumentParser, what: str) -> None:
    """``--nproc``, the one flag for a number of ranks (devices), with the older names hidden."""
    p.add_argument("--nproc", type=int, default=None, help=what)
    for alias in NPROC_ALIASES:
        p.add_argument(alias, type=int, dest="nproc", default=None, help=argparse.SUPPRESS)


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="model preset, e.g. 8b; alone (no --config), its own "
                   "configs/<model>.toml is the base; with --config, it replaces that file's model.name")


def apply_model(args: argparse.Namespace, overrides: list[str]) -> tuple[list[str], str]:
    """``--model NAME``: (overrides with ``--model.name=NAME`` first, what to tell the user). With no
    ``--config``, the preset's own ``configs/<NAME>.toml`` (its sequence, batch, precision) becomes the
    config, not the built-in defaults' debug shape; ``args.config`` is set to it."""
    model = getattr(args, "model", "")
    if not model:
        return overrides, ""
    said = ""
    if not args.config and model in PRESETS:  # (an unknown preset: the config check's error follows)
        if path := preset_toml(model):
            args.config = str(path)
            said = (f"--model {model}: starting from {path.name} (its sequence, batch, precision and "
                    "checkpointing); --config FILE starts from another")
        else:
            said = f"--model {model} has no configs/{model}.toml: the built-in defaults' other sections apply"
    return [f"--model.name={model}", *overrides], said


PATH_FLAGS = ("checkpoint", "hf", "messages", "to_hf", "from_hf", "tasks_path")
"""Flags that name an existing file or folder (--config: read_config says more of a missing one)."""


def check_paths(args: argparse.Namespace) -> None:
    """Each path flag given names something that exists: one line, before any work (and torch)."""
    for name in PATH_FLAGS:
        if (path := getattr(args, name, None)) and not Path(path).exists():
            raise ConfigError(f"--{name.replace('_', '-')} '{path}' does not exist")


def nproc_notice(argv: list[str]) -> None:
    """A notice for each older spelling of ``--nproc`` on the command line."""
    for alias in NPROC_ALIASES:
        if any(a == alias or a.startswith(alias + "=") for a in argv):
            notice(f"{alias} is now --nproc (one name for the number of ranks in train, plan, estimate, "
                   "verify and eval); the old name still works")


def check_nproc(args: argparse.Namespace) -> None:
    """``--nproc``, where a command has it and it is given, is at least 1 (every command, once)."""
    if (nproc := getattr(args, "nproc", None)) is not None and nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")


def need_nproc(args: argparse.Namespace, what: str) -> int:
    """The ``--nproc`` a command cannot do without (plan, estimate)."""
    if args.nproc is None:
        raise ConfigError(f"{args.command} needs --nproc N: the number of {what}")
    return args.nproc


def version() -> str:
    """``shardwise --version``: the installed package's version."""
    try:
        return f"shardwise {dist_version('shardwise')}"
    except PackageNotFoundError:
        return "shardwise (not installed: run from a source tree)"


def _suggest(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``shardwise``'s parser and its commands' parsers by name, in the order a user meets them."""
    parser = _Parser(
        prog="shardwise", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="PyTorch-native N-D parallel LLM training.",
        epilog="examples (shardwise COMMAND --help for each command's flags and more examples):\n"
               + "\n".join(f"  {EXAMPLES[name][0]}" for name in EXAMPLES))
    sub = parser.add_subparsers(dest="command", required=True)
    for make in (train_parser, prepare_parser, plan_parser, estimate_parser, calibrate_parser, verify_parser,
                 compare_parser, generate_parser, eval_parser, convert_parser, report_parser):
        make(sub)
    parser.add_argument("--version", action="version", version=version())
    return parser, sub.choices


def check_command(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> None:
    """A misspelt command, refused with the nearest one (before argparse's own list)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    if word is not None and argv and not argv[0].startswith("-") and word not in commands:
        raise ConfigError(f"unknown command '{word}'{_suggest(word, list(commands))} "
                          f"(commands: {', '.join(commands)})")


def check_unknown_flags(parser: argparse.ArgumentParser, rest: list[str]) -> None:
    """A flag the command does not have and that is not a --section.key override: refused with the
    nearest flag (``--confg`` -> ``--config``)."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    keys = [f"--{section}.{name}" for section, cls in sections().items() for name in section_fields(cls)]
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and "." not in name and name not in flags:
            same = [k for k in keys if k.rsplit(".", 1)[1] == name[2:]]  # --steps: --training.steps
            hint = (f"; did you mean {' or '.join(repr(k) for k in same)}?" if same
                    else _suggest(name, flags))
            raise ConfigError(f"unknown flag '{name}' for '{parser.prog}'{hint} (config keys take the form "
                              "--section.key=value)")


def generate_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "generate", "sample text from a checkpoint or an HF folder",
                "Continue a prompt, or answer a conversation, with a trained model: "
                "greedy (--temperature 0) or sampled, with a KV cache.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a step-<N> checkpoint, or a run directory (its latest one)")
    src.add_argument("--hf", help="a Hugging Face model folder (config.json, safetensors, tokenizer)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue")
    what.add_argument("--messages", help="a JSON file with a list of {role, content} messages")
    p.add_argument("--tokenizer", default="", help="tokenizer folder or tokenizer.json (default: the "
                   "run's data.tokenizer, or the HF folder's)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each token")
    p.add_argument("--json", action="store_true", help="print {prompt_tokens, tokens, text} as JSON")
    add_skip_checksums(p)


def eval_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "eval", "loss and perplexity of a checkpoint on a data set",
                "Score a checkpoint: its mean token loss and perplexity over every "
                "whole global batch of a data set, prepared as training prepares it "
                "(the run's config.toml, or --config, with --section.key=value "
                "overrides: --data.path FILE_OR_FOLDER scores other data). Any layout "
                "(--parallel.*) on --nproc ranks or under torchrun.")
    p.add_argument("--checkpoint", required=True, help="a step-<N> checkpoint, or a run directory (its "
                   "latest one)")
    p.add_argument("--config", help="TOML for the data, batch and layout (default: the run's config.toml)")
    p.add_argument("--split", default="auto", choices=["auto", "val", "all"],
                   help="held-out part (val) or all of each source; auto: val of the run's own data, "
                        "all of data named by --data.path / --data.sources")
    add_nproc(p, "local ranks to score on (not under torchrun, which sets them)")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--tasks", default="", help="comma-separated lm-evaluation-harness tasks to score instead "
                   "(one device; needs pip install 'shardwise[eval]')")
    p.add_argument("--tasks-path", default="", help="a folder of task YAML files for --tasks (local data)")
    p.add_argument("--limit", type=int, default=None, help="--tasks: at most this many examples per task")
    p.add_argument("--num-fewshot", type=int, default=None, help="--tasks: few-shot examples per prompt")
    add_skip_checksums(p)


def train_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "train", "train a model",
                "Train a model. Any config key can be overridden with "
                "--section.key=value (see --help-config).")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml (default: built-in defaults)")
    add_model(p)
    add_nproc(p, "launch this many local ranks (not under torchrun, which sets them)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart all ranks this many times after a rank fails")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")


def verify_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "verify", "prove layouts match the 1-rank run",
                "Train the 1-rank reference and each layout for --steps steps from "
                "one seed checkpoint; compare losses and final parameters against "
                "documented tolerances. Extra --section.key=value overrides apply "
                "to every run.")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    add_model(p)
    add_nproc(p, "ranks of every layout: a layout without dp_shard fills it to this many; without "
                 "--layouts, verify dp_shard=N and (N even) tp=2 with dp_shard=N/2")
    p.add_argument("--layouts", nargs="+", default=None,
                   help="layouts as degree lists, e.g. dp_shard=4 tp=2,dp_shard=2 (each one's product of "
                        "degrees is its number of ranks)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of every run")
    p.add_argument("--out", default="runs/verify", help="where runs, logs and the plot go")
    p.add_argument("--localize", action="store_true",
                   help="name where each layout first departs from the reference (module output or "
                        "gradient of step 1), not only the failing ones")
    p.add_argument("--moe-routing", default="replay", choices=["replay", "free"],
                   help="MoE models: each layout replays the reference's expert choices per token and "
                        "reports where its own router differs (default), or routes freely (a near-tie "
                        "broken the other way then fails the layout)")


def compare_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "compare", "where two run traces first differ",
                "Compare two traces written by train --debug.trace FILE (every rank's file): "
                "say they are bitwise equal, or name the first step and module output (or "
                "gradient) where they differ, with both norms and the last signature that "
                "agreed. Exit 0 when they agree, 1 when they differ.")
    p.add_argument("a", help="a trace file (rank 0's; the FILE.rankN files beside it are compared too)")
    p.add_argument("b", help="the trace to compare it with")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="differ only where a norm differs by more than this, relative (0: any bit)")


def add_skip_checksums(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-checksums", action="store_true",
                   help="check the checkpoint's file sizes only, not their SHA-256 (faster on a large one; "
                        "as checkpoint.verify_checksums=false in training)")


def add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing {what} (otherwise an existing file, or a folder holding "
                        "files, is refused)")


def report_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "report", "HTML + PNG report of one or more runs",
                "Write a self-contained HTML page and PNGs (loss, lr, grad norm, "
                "tokens/s, MFU, memory and step time per rank) for the given run "
                "directories, overlaid for comparison.")
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default="", help="output folder (default: RUN_DIR/report for one run, "
                                             "runs/report for several)")
    p.add_argument("--screenshot", action="store_true",
                   help="also render the page in headless Chromium to report.png")
    add_overwrite(p, "--out")


def convert_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "convert", "HF safetensors <-> shardwise checkpoint",
                "Export a checkpoint to a Hugging Face folder (config.json + "
                "safetensors; Llama, Qwen3 or Qwen3-MoE by the model's shape), or "
                "import one as a weights-only checkpoint to start training from. "
                "Import reads the model shape from the folder's config.json and "
                "writes a training config for it (--toml); with --config (and "
                "--model.* overrides) it checks the HF config against that model.")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-hf", metavar="CHECKPOINT", help="a step-<N> checkpoint directory to export")
    way.add_argument("--from-hf", metavar="HF_DIR", help="an HF model folder to import")
    p.add_argument("--out", required=True, help="output folder (HF folder, or the new checkpoint)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="export dtype")
    p.add_argument("--config", help="TOML config: its other sections go into the written config "
                "(import only); with model fields, they must match config.json")
    p.add_argument("--toml", help="import: the training config to write (default: <out>.toml)")
    add_skip_checksums(p)
    add_overwrite(p, "--out and --toml")


def prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "prepare", "tokenize the data into memory-mapped shards",
                "Stream data.path (or each of data.sources, and data.val_path), "
                "tokenize it on every core and write the token shards training "
                "memory-maps, into data.prepared_dir (or the cache). Run it on a CPU "
                "node before a GPU job; an interrupted run resumes from the shards "
                "it finished. Extra --section.key=value overrides apply.")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    add_model(p)


def estimate_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "estimate", "per-rank memory, communication and step time of a layout",
                "Predict, without the cluster, what one layout costs per rank: "
                "parameters, gradients and optimizer states (exact: the real model "
                "built and parallelized on torch's fake process group), activations "
                "and the step's peak memory, every collective with its bytes, and "
                "the step time on a hardware profile. Overrides --section.key=value "
                "apply as in train.")
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    add_model(p)
    add_nproc(p, "number of ranks (devices), required")
    p.add_argument("--hardware", default="h100",
                   help="h100, h200, a100, b200, mi300x, local (after `shardwise calibrate`) or a .toml")
    p.add_argument("--json", default="", help="also write the estimate as JSON to this file")
    add_overwrite(p, "--json")


def plan_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "plan", "rank the layouts of a model on a cluster",
                "Enumerate layouts (pp, dp_replicate, dp_shard, cp, tp, ep, pipeline "
                "schedule, micro-batch, activation checkpointing), drop those the "
                "trainer would refuse or that do not fit in memory, rank the rest by "
                "predicted tokens/s per device, print the best and write the first "
                "as a ready-to-run config. Overrides --section.key=value (e.g. "
                "--float8.enabled true) apply to every candidate.")
    p.add_argument("--config", help="TOML giving everything but the layout (default: built-in defaults)")
    add_model(p)
    add_nproc(p, "number of devices (ranks), required")
    p.add_argument("--hardware", default="h100", help="hardware profile (see estimate)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's)")
    p.add_argument("--global-batch-tokens", default="",
                   help="tokens per optimizer step, e.g. 4M (default: one sequence of --seq tokens per "
                        "device, and at least the config's training.global_batch, which counts sequences)")
    p.add_argument("--top", type=int, default=5, help="layouts to show (each estimated exactly)")
    p.add_argument("--ac", default="none,selective,selective_half,full",
                   help="activation-checkpointing modes to try")
    p.add_argument("--schedules", default="1f1b,interleaved1f1b,zbv", help="pipeline schedules to try")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="usable fraction of device memory (allocator fragmentation, CUDA context)")
    p.add_argument("--out", default=None, help="where the best layout's config is written (default: "
                   "plan.toml, an earlier one kept aside; '' = not written)")
    add_overwrite(p, "--out")


def calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "calibrate", "measure this machine for --hardware local",
                "Measure GEMM and attention throughput per dtype and thread count, "
                "memory bandwidth, gloo collective bandwidth and latency among local "
                "processes, and the host overhead of a step; save them as the 'local' "
                "hardware profile (two to five minutes on 2 cores; --quick, about 40 s).")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and shorter timings (about 40 s on 2 cores; noisier)")
