"""A second model family, written here with its own module names, parallelized by ``parallel/``
as it is: tensor parallel, float8's choice and the pipeline's split read the plans the family
declares (shardwise/models/protocol.py), so a new family adds nothing to ``parallel/``."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.config.schema import Float8Config, ParallelConfig
from shardwise.models.protocol import BlockPlan, LinearGroup, ModelPlan
from shardwise.parallel.dims import Mesh
from shardwise.parallel.float8 import float8_choice
from shardwise.parallel.pipeline import split_stage
from shardwise.parallel.tensor import apply_tp
from shardwise.plan.states import fake_world

DIM, HIDDEN, VOCAB = 32, 64, 96


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, -1, 8).transpose(1, 2) for m in (self.query, self.key, self.value))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x) * torch.sigmoid(self.gate(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.mixer, self.post, self.mlp = Norm(), Mixer(), Norm(), Gated()

    @property
    def plan(self) -> BlockPlan:
        return BlockPlan((LinearGroup("mixer", ("query", "key", "value"), ("out",)),
                          LinearGroup("mlp", ("up", "gate"), ("down",))), sequence_norms=("pre", "post"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.pre(x))
        return x + self.mlp(self.post(x))


class Toy(nn.Module):
    plan = ModelPlan(embedding="wte", norm="ln_f", head="lm_head")

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.ln_f, self.lm_head = Norm(), nn.Linear(DIM, VOCAB, bias=False)

    def placeholder_forward(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _placements(model: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}


def test_tensor_parallel_applies_a_new_familys_plan():
    """Column-parallel linears split their outputs (dim 0), row-parallel ones their inputs (dim 1),
    the embedding and head the vocabulary; norms are replicated."""
    with torch.device("meta"):
        model = Toy()
    with fake_world(2, 0):
        apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=(Mesh.TP,)), ParallelConfig(tp=2))
        got = _placements(model)
    column, row = (Shard(0),), (Shard(1),)
    for i in range(2):
        for name in ("mixer.query", "mixer.key", "mixer.value", "mlp.up", "mlp.gate"):
            assert got[f"layers.{i}.{name}.weight"] == column, name
        assert got[f"layers.{i}.mixer.out.weight"] == got[f"layers.{i}.mlp.down.weight"] == row
        assert got[f"layers.{i}.pre.scale"] == got[f"layers.{i}.post.scale"] == (Replicate(),)
    assert got["wte.weight"] == got["lm_head.weight"] == column and got["ln_f.scale"] == (Replicate(),)
    assert len(got) == len(list(model.parameters()))


def test_float8_and_the_pipeline_read_a_new_familys_plan():
    model = Toy(n_layers=4)
    groups, kept, refused = float8_choice(model, Float8Config(enabled=True, min_dim=16), tp=2)
    assert list(groups) == [f"layers.{i}.{g}" for i in range(4) for g in ("mixer", "mlp")] and not refused
    assert set(kept) == {"lm_head"}
    first, last = split_stage(model, 0, 2), split_stage(model, 1, 2)
    assert first.wte is not None and first.ln_f is None and first.lm_head is None
    assert list(first.layers) == ["0", "1"]
    assert last.wte is None and last.lm_head is not None and list(last.layers) == ["2", "3"]
