"""``verify --ranks`` measures each simulated rank's full copy of a parameter without gathering it:
each rank's shard against the same cut of the reference, the sums all-reduced over the mesh dims that
shard it. The figures equal those of the gathered copies (which hold N full tensors at once), on
uneven FSDP chunks under TP's strided shards and with HSDP replicas, and a replica that drifted is
that replica's error only."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode

from shardwise.models.transformer import build_model, init_weights
from shardwise.resolve.checks import load_config
from shardwise.resolve.run import resolve_model
from shardwise.trainer import simulate
from shardwise.verify import simulated
from shardwise.verify.distance import tensor_update_error

LAYOUTS = {  # (a vocabulary of 2,050 rows: FSDP's chunks of the tp halves are uneven over 3 ranks)
    "tp2_fsdp3": (6, ["--parallel.tp=2", "--parallel.dp_shard=3"]),
    "hsdp2x2_tp2": (8, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.tp=2"]),
}


def _gathered(p: torch.Tensor, ref: torch.Tensor, seed: torch.Tensor) -> dict[int, float]:
    """The measure the old way: every rank's full copy gathered, then compared."""
    full = simulate.every_rank_tensor(p.full_tensor())
    with maybe_disable_local_tensor_mode():
        return {r: tensor_update_error(v, ref, seed) for r, v in full.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_ranks_error_is_that_of_its_full_copy_without_gathering_it(layout: str,
                                                                          monkeypatch: pytest.MonkeyPatch):
    world, degrees = LAYOUTS[layout]
    cfg = load_config(None, ["--model.name=debug", "--model.vocab_size=2050", "--model.n_layers=2",
                             "--training.mixed_precision=fp32", "--compile.enabled=false",
                             "--debug.deterministic=true", "--eval.interval=0", "--training.seq_len=32",
                             "--training.global_batch=12", *degrees])
    model = build_model(resolve_model(cfg), device="cpu")
    init_weights(model, 0)
    seed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    ref = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in seed.items()}  # (a moved "reference")
    seen: dict[str, tuple[dict[int, float], dict[int, float]]] = {}
    drift: dict[str, dict[int, float]] = {}
    measured = simulated.param_error

    def both(rank_model: torch.nn.Module, r: dict, s: dict) -> tuple[float, str]:
        for name, p in rank_model.named_parameters():
            seen[name] = (simulated._rank_errors(p, r[name], s[name]), _gathered(p, r[name], s[name]))
        # One rank's shard of one weight drifts: the ranks whose copies hold that shard see it.
        p = rank_model.get_parameter("layers.0.attention.wq.weight")
        local = p._local_tensor
        shards = dict(local._local_tensors)
        with maybe_disable_local_tensor_mode():
            shards[world - 1] = shards[world - 1] + 1e-2
        p._local_tensor = LocalTensor(shards)
        drift["after"] = simulated._rank_errors(p, r[p_name], s[p_name])
        drift["gathered"] = _gathered(p, r[p_name], s[p_name])
        p._local_tensor = local
        return measured(rank_model, r, s)

    p_name = "layers.0.attention.wq.weight"
    monkeypatch.setattr(simulated, "param_error", both)
    simulated.train_simulated(cfg, world, 1, seed, ref)
    assert len(seen) == len(ref)
    for name, (mine, gathered) in seen.items():
        assert mine.keys() == gathered.keys() == set(range(world)), name
        for r in mine:
            assert math.isclose(mine[r], gathered[r], rel_tol=1e-9), (name, r, mine[r], gathered[r])
    before = seen[p_name][0]
    after, gathered = drift["after"], drift["gathered"]
    for r in range(world):
        assert math.isclose(after[r], gathered[r], rel_tol=1e-9), (r, after[r], gathered[r])
    moved = {r for r in range(world) if after[r] > before[r] * 1.01}
    assert world - 1 in moved
    if "dp_replicate" in layout:  # the other replica's copies are untouched
        assert moved == set(range(world // 2, world)), moved
        assert all(after[r] == before[r] for r in range(world // 2))
