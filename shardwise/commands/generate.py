"""``shardwise generate``: continue a prompt or answer a conversation with a trained model."""

from __future__ import annotations

import argparse

from shardwise.commands.common import add_skip_checksums

NAME = "generate"
SUMMARY = "sample text from a checkpoint or an HF folder"
DESCRIPTION = (
    "Continue a prompt, or answer a conversation, with a trained model: greedy (--temperature 0) or "
    "sampled, with a KV cache."
)
EXAMPLES = (
    "shardwise generate --checkpoint runs/debug --prompt 'In the beginning'",
    "shardwise generate --hf hf-out --prompt 'In the beginning' --temperature 0.8",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue")
    what.add_argument("--messages", help="a JSON file with a list of {role, content} messages")
    add_sampling(p, max_new_tokens=64)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each token")
    p.add_argument("--json", action="store_true", help="print {prompt_tokens, tokens, text} as JSON")
    add_skip_checksums(p)


def add_model_source(p: argparse.ArgumentParser) -> None:
    """The model to load (a checkpoint or an HF folder or Hub id), with its tokenizer (generate, chat)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a step-<N> checkpoint, or a run directory (its latest one)")
    src.add_argument("--hf", help="a Hugging Face model folder (config.json, safetensors, tokenizer), or a "
                     "Hub id (ORG/NAME)")
    p.add_argument("--adapter", default="", help="with --hf: a PEFT LoRA folder (adapter_config.json + "
                   "adapter_model.safetensors) put on that model, as peft.PeftModel.from_pretrained does")
    p.add_argument("--tokenizer", default="", help="tokenizer folder or tokenizer.json (default: the "
                   "run's data.tokenizer, or the HF folder's)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 on a GPU, fp32 on a CPU")


def add_sampling(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """How tokens are chosen (generate, chat: one meaning for each flag)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    from shardwise.infer.generate import generate_command

    return generate_command(args, overrides)
