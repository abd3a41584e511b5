"""--debug.comm: the collectives of one step, per mesh dim, with exact byte counts for FSDP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.models import model_args
from shardwise.models.transformer import build_model
from shardwise.resolve.checks import load_config
from tests.helpers import TINY_ARGS, run_cli

pytestmark = pytest.mark.dist


def comm(tmp: Path, cache: str, *extra: str) -> dict:
    run_cli(["train", *TINY_ARGS, f"--data.cache_dir={cache}", f"--run.dir={tmp}", "--training.steps=1",
             "--lr_scheduler.warmup_steps=1", "--debug.comm=true", *extra])
    return json.loads((tmp / "comm.json").read_text())


def test_fsdp_bytes_are_exact(tmp_path: Path, data_cache: str):
    """fp32 FSDP moves every parameter once in the forward all-gather, again in backward for every
    block that was resharded after forward (all but the last), and every gradient once in the
    reduce-scatter."""
    data = comm(tmp_path, data_cache, "--nproc=2", "--parallel.dp_shard=2")
    model = build_model(model_args(load_config(tmp_path / "config.toml").model))
    total = 4 * sum(p.numel() for p in model.parameters())
    resharded = 4 * sum(p.numel() for p in model.layers["0"].parameters())  # 2 layers: all but the last
    dp = data["totals"]["dp_shard"]
    assert dp["all_gather"] == total + resharded
    assert dp["reduce_scatter"] == total
    assert set(data["totals"]) == {"dp_shard"}  # nothing else communicates in pure FSDP


def test_tp_collectives_are_on_the_tp_dim(tmp_path: Path, data_cache: str):
    data = comm(tmp_path, data_cache, "--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2")
    assert {"all_gather", "reduce_scatter"} <= set(data["totals"]["tp"])
    assert {"all_gather", "reduce_scatter"} <= set(data["totals"]["dp_shard"])
    attention = [r for r in data["rows"] if r["module"].endswith("layers.0.attention")
                 and r["phase"] == "forward"]
    assert attention and attention[0]["collective"] == "all_gather" and attention[0]["mesh_dim"] == "tp"


def test_pipeline_send_recv_on_the_pp_dim(tmp_path: Path, data_cache: str):
    """Under PP (no per-module attribution: stages run backward through autograd.grad) the stages'
    point-to-point traffic is counted on the pp dim."""
    data = comm(tmp_path, data_cache, "--nproc=2", "--parallel.pp=2", "--training.micro_batch=2",
                "--data.document_mask=false")
    assert {"send", "recv"} <= set(data["totals"]["pp"])
    assert all(r["module"] == "(pipeline stage)" for r in data["rows"])


def test_cp_ring_bytes_are_exact(tmp_path: Path, data_cache: str):
    """Ring attention (cp=2, all-gather rotation): each block's forward and backward all-gather the
    local K and V shards of the cp group (counted as gathered bytes), and the backward passes the
    key/value gradients around the ring once per ring step (all-to-all)."""
    data = comm(tmp_path, data_cache, "--nproc=4", "--parallel.dp_shard=2", "--parallel.cp=2",
                "--data.document_mask=false")
    cfg = load_config(tmp_path / "config.toml")
    args, cp = model_args(cfg.model), 2
    micro_batch = cfg.training.global_batch // 2  # dp_shard=2
    kv_local = micro_batch * args.n_kv_heads * (cfg.training.seq_len // cp) * args.head_dim * 2 * 4
    ring = data["totals"]["cp"]
    assert ring["all_gather"] == args.n_layers * 2 * cp * kv_local
    assert ring["all_to_all"] == args.n_layers * cp * kv_local
    assert set(data["totals"]) == {"cp", "dp_shard_cp"}  # FSDP shards over dp_shard x cp


def test_cp_document_attention_bytes_are_exact(tmp_path: Path, data_cache: str):
    """Document masks under cp=2: each block's forward all-gathers K and V once (the whole window's,
    kept for backward) and its backward reduce-scatters their gradients once -- the planner's terms."""
    data = comm(tmp_path, data_cache, "--nproc=2", "--parallel.cp=2", "--data.document_mask=true")
    cfg = load_config(tmp_path / "config.toml")
    args = model_args(cfg.model)
    micro_batch = cfg.training.global_batch  # one data-parallel rank, no accumulation
    kv_gathered = micro_batch * args.n_kv_heads * cfg.training.seq_len * args.head_dim * 4  # K or V, fp32
    attention = {}  # (FSDP shards over the same two ranks: its rows are the other modules')
    for r in data["rows"]:
        if r["module"].endswith("attention.core"):
            assert r["mesh_dim"] == "cp"
            key = (r["phase"], r["collective"])
            attention[key] = attention.get(key, 0) + r["bytes"]
    assert attention == {("forward", "all_gather"): args.n_layers * 2 * kv_gathered,
                         ("backward", "reduce_scatter"): args.n_layers * 2 * kv_gathered}
    assert "all_to_all" not in data["totals"]["cp"]
