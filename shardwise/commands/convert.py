"""``shardwise convert``: a checkpoint to a Hugging Face folder, or an HF folder to a checkpoint
and the training config for it."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.commands.common import add_overwrite, add_skip_checksums
from shardwise.config.outputs import target
from shardwise.config.schema import ConfigError

NAME = "convert"
SUMMARY = "HF safetensors <-> shardwise checkpoint"
DESCRIPTION = (
    "Export a checkpoint to a Hugging Face folder (config.json + safetensors; Llama, Qwen3 or Qwen3-MoE "
    "by the model's shape), or import one as a weights-only checkpoint to start training from. Import "
    "reads the model shape from the folder's config.json and writes a training config for it (--toml); "
    "with --config (and --model.* overrides) it checks the HF config against that model."
)
EXAMPLES = (
    "shardwise convert --to-hf runs/debug/checkpoints/step-100 --out hf-out",
    "shardwise convert --from-hf Qwen3-0.6B --out ckpt/qwen3",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-hf", metavar="CHECKPOINT", help="a step-<N> checkpoint directory to export")
    way.add_argument("--from-hf", metavar="HF_DIR", help="an HF model folder to import")
    p.add_argument("--out", required=True, help="output folder (HF folder, or the new checkpoint)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="export dtype")
    p.add_argument("--adapter", action="store_true", help="--to-hf of a LoRA checkpoint: its adapters alone, "
                   "as a PEFT folder (adapter_config.json + adapter_model.safetensors), not the merged model")
    p.add_argument("--config", help="TOML config: its other sections go into the written config "
                "(import only); with model fields, they must match config.json")
    p.add_argument("--toml", help="import: the training config to write (default: <out>.toml)")
    add_skip_checksums(p)
    add_overwrite(p, "--out and --toml")


def exported(args: argparse.Namespace, overrides: list[str]) -> tuple[Path, list[Path]]:
    """``--to-hf``: the checkpoint exported (a run directory: its latest); (the checkpoint, the
    safetensors files written under ``--out``)."""
    from shardwise.checkpoint import checkpoint_or_latest
    from shardwise.checkpoint import hf as convert
    from shardwise.checkpoint.peft import export_adapter

    if overrides or args.config or args.toml:
        raise ConfigError("convert --to-hf reads the model config from the checkpoint's manifest: "
                          "drop --config, --toml and overrides")
    source = Path(args.to_hf)
    source = checkpoint_or_latest(source) if source.is_dir() else source  # (a run: its latest)
    where = target(args.out, "--out", args.overwrite)
    export = export_adapter if args.adapter else convert.export_hf
    with where.staging() as staging:
        files = export(source, staging, args.dtype, checksums=not args.skip_checksums)
    return source, [Path(args.out) / Path(f).name for f in files]  # (the folder's own files)


def imported(args: argparse.Namespace, overrides: list[str]) -> tuple[Path, str]:
    """``--from-hf``: the HF folder imported as a checkpoint at ``--out``, and the training config
    for it written; (that config's path, the model's preset name or '')."""
    from shardwise.checkpoint import hf as convert
    from shardwise.config.types import read_toml
    from shardwise.models.hf_config import hf_tokenizer
    from shardwise.resolve.checks import load_config

    if args.adapter:
        raise ConfigError("--adapter exports a LoRA checkpoint's adapters (--to-hf); an import reads a model "
                          "folder")
    out = Path(args.out)
    toml = Path(args.toml or f"{out}.toml")
    where, where_toml = target(out, "--out", args.overwrite), target(toml, "--toml", args.overwrite,
                                                                     folder=False)
    cfg = load_config(args.config, overrides)
    # The model comes from config.json unless the user named one (a preset or model fields).
    named = bool(args.config and "model" in read_toml(Path(args.config), "config file")) or any(
        o.startswith("--model.") for o in overrides)
    with where.staging() as staging:
        _, model = convert.import_hf(Path(args.from_hf), staging, cfg.model if named else None)
    cfg.model = model
    cfg.checkpoint.path = str(out)
    cfg.data.tokenizer = cfg.data.tokenizer or hf_tokenizer(Path(args.from_hf))  # the model's own
    where_toml.write(cfg.to_toml())
    return toml, model.name


def run(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    if args.to_hf:
        source, files = exported(args, overrides)
        what = "its LoRA adapters as a PEFT folder" if args.adapter else \
            f"{sum(f.suffix == '.safetensors' for f in files)} safetensors file(s)"
        print(f"exported {source} -> {args.out} ({what}, {args.dtype})")
        return 0
    toml, name = imported(args, overrides)
    print(f"imported {args.from_hf} -> {args.out} (model {name or 'from config.json'}); train from it: "
          f"shardwise train --config {toml}")
    return 0
