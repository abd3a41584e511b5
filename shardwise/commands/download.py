"""``shardwise download``: a Hub model or dataset into the Hugging Face cache (or a folder), for a
machine whose compute nodes have no network."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.commands.common import add_overwrite

NAME = "download"
SUMMARY = "fetch a Hub model or dataset for runs without network"
DESCRIPTION = (
    "Fetch a Hugging Face model (config, tokenizer and safetensors: never code or pickled weights) or a "
    "dataset's corpus files into the Hugging Face cache (HF_HOME), where every command that takes an HF "
    "folder or a Hub id finds it, offline included; with --out, into a plain folder instead."
)
EXAMPLES = (
    "shardwise download Qwen/Qwen3-0.6B",
    "shardwise download hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT",
    "shardwise download Qwen/Qwen3-0.6B --out models/qwen3-0.6b",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", metavar="ID", help="ORG/NAME[@REVISION] (a model), or "
                   "hf://datasets/ORG/NAME[@REVISION][/PATH] (a dataset, or a folder or file of it)")
    p.add_argument("--out", help="a folder to hold the files (default: the Hugging Face cache)")
    add_overwrite(p, "--out folder")


def downloaded(args: argparse.Namespace, overrides: list[str]) -> tuple[str, Path]:
    """``args.id`` fetched into the cache (or ``--out``): ("model" or "dataset", where it is)."""
    from shardwise.config.outputs import target
    from shardwise.config.schema import ConfigError
    from shardwise.runtime.hub import download

    if overrides:
        raise ConfigError(f"download takes an id and --out, not config flags ({overrides[0]})")
    if args.out is None:
        return download(args.id)
    where = target(args.out, "--out", args.overwrite)
    with where.staging() as staging:
        kind, inside = download(args.id, staging)
    return kind, Path(args.out) / inside.resolve().relative_to(staging.resolve())


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    kind, folder = downloaded(args, overrides)
    if args.out is None:
        print(f"downloaded {args.id} ({kind}) -> {folder}\nany command finds it by its id, offline too "
              "(HF_HUB_OFFLINE=1), with the same HF_HOME")
    else:
        print(f"downloaded {args.id} ({kind}) -> {args.out}")
    return 0
