"""The flags of the commands whose code lives outside cli.py (``generate``: shardwise/generate.py;
``eval``: shardwise/eval_command.py): the CLI builds every parser before it imports torch, so ``--help``
and a bad flag answer at once."""

from __future__ import annotations

import argparse
import difflib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from shardwise.config import section_fields, sections
from shardwise.config_types import ConfigError


def version() -> str:
    """``shardwise --version``: the installed package's version."""
    try:
        return f"shardwise {dist_version('shardwise')}"
    except PackageNotFoundError:
        return "shardwise (not installed: run from a source tree)"


def _suggest(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


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
    p = sub.add_parser("generate", help="sample text from a checkpoint or an HF folder", allow_abbrev=False,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Continue a prompt, or answer a conversation, with a trained model: "
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


def eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a data set", allow_abbrev=False,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Score a checkpoint: its mean token loss and perplexity over every "
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
    p.add_argument("--nproc", type=int, default=None, help="local ranks (not under torchrun)")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--tasks", default="", help="comma-separated lm-evaluation-harness tasks to score instead "
                   "(one device; needs pip install 'shardwise[eval]')")
    p.add_argument("--tasks-path", default="", help="a folder of task YAML files for --tasks (local data)")
    p.add_argument("--limit", type=int, default=None, help="--tasks: at most this many examples per task")
    p.add_argument("--num-fewshot", type=int, default=None, help="--tasks: few-shot examples per prompt")
