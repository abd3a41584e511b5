"""``shardwise prepare``: tokenize the data into the memory-mapped shards training reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.commands.common import add_model

NAME = "prepare"
SUMMARY = "tokenize the data into memory-mapped shards"
DESCRIPTION = (
    "Stream data.path (or each of data.sources, and data.val_path), tokenize it on every core and write "
    "the token shards training memory-maps, into data.prepared_dir (or the cache). Run it on a CPU node "
    "before a GPU job; an interrupted run resumes from the shards it finished. Extra "
    "--section.key=value overrides apply."
)
EXAMPLES = (
    "shardwise prepare --config configs/debug.toml --data.path corpus/",
    "shardwise prepare --config configs/debug.toml --show-window kjv:1332",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML preset, e.g. configs/debug.toml")
    add_model(p)
    p.add_argument("--show-window", metavar="SOURCE:INDEX",
                   help="print one training window's text (a loss spike's notice names its windows) at "
                        "training.seq_len, instead of the summary")


def prepared(args: argparse.Namespace, overrides: list[str]) -> tuple[list[tuple[Path, dict]], list[str]]:
    """Every source of ``args``' data prepared (or resumed): each prepared folder with its manifest,
    and for chat data the packing's notices. What :func:`run` reports and ``shardwise.prepare``
    returns."""
    import json

    from shardwise.data.prepare import prepare
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.resolve.checks import load_config

    cfg = load_config(args.config, overrides)
    from shardwise.data.dataset import pack_prepared, refuse_synthetic  # (after the checks: imports torch)

    refuse_synthetic(cfg.data)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    folders = [(f, json.loads((f / "manifest.json").read_text())) for f in prepare(cfg.data, tokenizer)]
    return folders, pack_prepared(cfg.data, tokenizer, cfg.training.seq_len)  # chat: whole conversations


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    if args.show_window:
        from shardwise.data.dataset import open_corpus, refuse_synthetic, show_window
        from shardwise.data.tokenizer import load_tokenizer
        from shardwise.resolve.checks import load_config

        cfg = load_config(args.config, overrides)
        refuse_synthetic(cfg.data)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        corpus = open_corpus(cfg.data, tokenizer)
        print(show_window(corpus, tokenizer, cfg.training.seq_len, args.show_window))
        return 0
    folders, packing = prepared(args, overrides)
    for where, m in folders:
        bad = f", {m['bad_rows']:,} bad rows skipped" if m["bad_rows"] else ""
        print(f"{where}: {m['shards']} shard(s), {m['docs']:,} documents and {m['tokens']:,} tokens to "
              f"train on, {m['val_docs']:,} documents and {m['val_tokens']:,} tokens held out{bad}")
    for line in packing:
        print(line)
    return 0
