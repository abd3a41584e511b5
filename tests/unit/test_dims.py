"""ParallelDims: degree resolution and one-line errors for impossible layouts."""

from __future__ import annotations

import pytest

from shardwise.config.schema import ConfigError, ParallelConfig
from shardwise.models import ModelArgs
from shardwise.parallel.dims import ParallelDims


def dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_dp_shard_takes_the_rest():
    d = dims(8, dp_replicate=2)
    assert (d.dp_replicate, d.dp_shard, d.dp) == (2, 4, 8)
    assert dims(1).dp_shard == 1


@pytest.mark.parametrize("world,kw,fragment", [
    (4, dict(dp_shard=3), "= 3 != world size 4"),
    (6, dict(dp_replicate=4), "world size 6 is not divisible by dp_replicate*cp*tp*pp=4"),
    (4, dict(dp_shard=0), "parallel.dp_shard must be >= 1"),
    (4, dict(dp_replicate=-1), "parallel.dp_replicate must be >= 1"),
    (4, dict(ep=3), "parallel.ep=3 must divide dp_shard*cp*tp=4"),
    (8, dict(ep=4, dp_replicate=4), "parallel.ep=4 must divide dp_shard*cp*tp=2"),
])
def test_impossible_layouts(world: int, kw: dict, fragment: str):
    with pytest.raises(ConfigError) as e:
        dims(world, **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_tp_is_accepted():
    d = dims(4, tp=2)
    assert (d.tp, d.dp_shard) == (2, 2)
    d.check_model(ModelArgs(), seq_len=512)


@pytest.mark.parametrize("tp,args,seq,fragment", [
    (3, ModelArgs(), 512, "parallel.tp=3 must divide model.n_heads=16"),
    (2, ModelArgs(n_heads=16, n_kv_heads=1), 512, "model.n_kv_heads=1"),
    (4, ModelArgs(dim=64, n_heads=4, n_kv_heads=4, multiple_of=2), 512, "the FFN hidden dim=170"),
    (2, ModelArgs(vocab_size=2049), 512, "model.vocab_size=2049"),
    (2, ModelArgs(), 511, "training.seq_len (sequence parallel)=511"),
    (2, ModelArgs(tie_embeddings=True), 512, "model.tie_embeddings with parallel.tp > 1"),
])
def test_check_model_divisibility(tp: int, args: ModelArgs, seq: int, fragment: str):
    d = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp)
    with pytest.raises(ConfigError) as e:
        d.check_model(args, seq)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("cp,tp,seq,fragment", [
    (2, 1, 66, "needs training.seq_len=66 divisible by 2*cp=4"),
    (4, 1, 100, "divisible by 2*cp=8"),
    (2, 4, 60, "parallel.tp=4 must divide the per-cp-rank sequence training.seq_len/cp=30"),
])
def test_cp_sequence_divisibility(cp: int, tp: int, seq: int, fragment: str):
    d = ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, ep=1, world_size=cp * tp)
    with pytest.raises(ConfigError) as e:
        d.check_model(ModelArgs(n_heads=16, n_kv_heads=4), seq)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("ep,args,fragment", [
    (2, ModelArgs(), "parallel.ep=2 needs an MoE model"),
    (4, ModelArgs(n_experts=6, moe_hidden_dim=32), "parallel.ep=4 must divide model.n_experts=6"),
])
def test_ep_needs_divisible_experts(ep: int, args: ModelArgs, fragment: str):
    d = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=1, pp=1, ep=ep, world_size=ep)
    with pytest.raises(ConfigError) as e:
        d.check_model(args, 512)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_pp_refuses_tied_embeddings():
    d = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    with pytest.raises(ConfigError, match="tie_embeddings with parallel.pp > 1"):
        d.check_model(ModelArgs(tie_embeddings=True), 512)


def test_pp_must_not_exceed_layers():
    d = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=8, ep=1, world_size=8)
    with pytest.raises(ConfigError, match="parallel.pp=8 exceeds model.n_layers=6"):
        d.check_model(ModelArgs(), 512)


def test_backend_options_are_built():
    from datetime import timedelta

    from shardwise.parallel.dims import backend_options, parse_backend_spec

    name, opts = parse_backend_spec("dp_replicate", "gloo:timeout_s=5:threads=3")
    assert (name, opts) == ("gloo", {"timeout_s": 5.0, "threads": 3})
    backend, o = backend_options(name, opts)
    assert backend == "gloo" and o._threads == 3 and o._timeout == timedelta(seconds=5)
    assert backend_options("gloo", {}) == "gloo"


@pytest.mark.parametrize("spec,fragment", [
    ("mpi", "backend must be one of gloo, nccl"),
    ("gloo:speed=9", "gloo has no option 'speed'"),
    ("gloo:threads=many", "expects int, got 'many'"),
])
def test_bad_backend_specs(spec: str, fragment: str):
    from shardwise.resolve.checks import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--parallel.backend_override=tp={spec}"])
    assert fragment in str(e.value) and "\n" not in str(e.value)
