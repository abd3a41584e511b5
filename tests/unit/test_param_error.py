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
    # Two stages per pipeline rank: the embedding's and the head's FSDP roots are the stage views
    # (each rank's own uneven chunk of them was once rank 0's: 513 rows on every rank).
    "pp2_interleaved_tp2_fsdp2": (8, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b",
                                      "--parallel.tp=2", "--parallel.dp_shard=2", "--model.n_layers=4",
                                      "--training.global_batch=16"]),
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
    drifts: list[tuple[int, dict[int, float], dict[int, float], dict[int, float]]] = []
    measured = simulated.param_error

    def both(rank_model: torch.nn.Module, r: dict, s: dict) -> tuple[float, str]:
        for name, p in rank_model.named_parameters():
            seen[name] = (simulated._rank_errors(p, r[name], s[name]), _gathered(p, r[name], s[name]))
        # One rank's shard of one weight drifts: the ranks whose copies hold that shard see it.
        name = next(n for n, _ in rank_model.named_parameters() if n.endswith("attention.wq.weight"))
        p = rank_model.get_parameter(name)
        local = p._local_tensor
        shards = dict(local._local_tensors)
        last = max(shards)
        with maybe_disable_local_tensor_mode():
            shards[last] = shards[last] + 1e-2
        p._local_tensor = LocalTensor(shards)
        drifts.append((last, seen[name][0], simulated._rank_errors(p, r[name], s[name]),
                       _gathered(p, r[name], s[name])))
        p._local_tensor = local
        return measured(rank_model, r, s)

    monkeypatch.setattr(simulated, "param_error", both)
    simulated.train_simulated(cfg, world, 1, seed, ref)
    assert seen.keys() == ref.keys()
    held = set()
    for name, (mine, gathered) in seen.items():
        assert mine.keys() == gathered.keys() and mine, name
        held |= mine.keys()
        for r in mine:
            assert math.isclose(mine[r], gathered[r], rel_tol=1e-9), (name, r, mine[r], gathered[r])
    assert held == set(range(world))
    for last, before, after, gathered in drifts:  # (one per pipeline rank's slice)
        for r in after:
            assert math.isclose(after[r], gathered[r], rel_tol=1e-9), (r, after[r], gathered[r])
        moved = {r for r in after if after[r] > before[r] * 1.01}
        assert last in moved
        if "dp_replicate" in layout:  # the other replica's copies are untouched
            assert moved == set(range(world // 2, world)), moved
            assert all(after[r] == before[r] for r in range(world // 2))
