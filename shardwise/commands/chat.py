"""``shardwise chat``: talk with a trained or Hugging Face model, turn by turn."""

from __future__ import annotations

import argparse

from shardwise.commands.common import add_skip_checksums
from shardwise.commands.generate import add_model_source, add_sampling

NAME = "chat"
SUMMARY = "a conversation with a checkpoint or an HF model"
DESCRIPTION = (
    "Talk with a model on its own chat template: each reply streams as it is made, and the KV cache "
    "keeps the conversation so a turn runs only its new tokens. /reset starts over, /exit (or Ctrl-D) "
    "leaves; Ctrl-C stops a reply."
)
EXAMPLES = (
    "shardwise chat --hf Qwen/Qwen3-0.6B",
    "shardwise chat --checkpoint runs/sft --system 'Answer briefly.' --temperature 0.7 --top-p 0.9",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source(p)
    p.add_argument("--system", default="", help="a system prompt opening the conversation")
    add_sampling(p, max_new_tokens=512)
    p.add_argument("--context", type=int, default=4096, help="the most tokens a conversation holds (its KV "
                   "cache, allocated up front; at most the model's context)")
    p.add_argument("--stats", action="store_true", help="after each reply: tokens run, reused from the "
                   "cache, generated, and tokens/s")
    add_skip_checksums(p)


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from shardwise.infer.chat import chat_command

    return chat_command(args, overrides)
