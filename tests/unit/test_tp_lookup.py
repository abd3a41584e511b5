"""The vocab-parallel embedding (shardwise/parallel/tensor.py ``VocabParallelLookup``): each tp rank
looks its own rows up and its backward fills only those rows -- DTensor's own row-wise lookup
computes the whole table's gradient on every rank -- with the same values and gradients as one
rank's ``nn.Embedding``, for vocabularies tp does not divide."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.models.transformer import build_model
from shardwise.parallel.pipeline import split_stage
from shardwise.parallel.tensor import VocabParallelLookup, apply_tp
from shardwise.trainer import simulate
from tests.helpers import TINY_MODEL, resolved_config


class _Backwards(TorchDispatchMode):
    """The table rows each embedding backward fills on a rank: a local call's ``num_weights``, or
    the rows of the local result of DTensor's call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.rows.append(out.to_local().shape[0] if isinstance(out, DTensor) else args[2])
        return out


@pytest.mark.parametrize("vocab", [96, 101])
def test_each_rank_looks_up_and_fills_only_its_own_rows(vocab: int) -> None:
    tp, dim = 4, 8
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, dim)
    tokens = torch.randint(0, vocab, (2, 12))
    grad_out = torch.randn(2, 12, dim)
    ref(tokens).backward(grad_out)
    copies = {r: tokens.clone() for r in range(tp)}
    with simulate.simulated_world(tp):
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        emb = nn.Embedding(vocab, dim)
        emb.load_state_dict(ref.state_dict())
        parallelize_module(emb, mesh, VocabParallelLookup(input_layouts=Replicate(), output_layouts=Shard(1)))
        backwards = _Backwards()
        mine = simulate.from_ranks(copies)  # (each rank's own tokens, as the trainer's)
        with backwards:
            out = emb(mine)  # (2, 12 / tp, dim): this rank's sequence shard
            out.backward(distribute_tensor(grad_out, mesh, (Shard(1),)).to_local())
        values = simulate.every_rank_tensor(out)
        rows = simulate.every_rank_tensor(emb.weight.to_local())
        grad = simulate.every_rank_tensor(emb.weight.grad.full_tensor())
    chunks = torch.chunk(torch.arange(vocab), tp)
    assert [rows[r].shape[0] for r in range(tp)] == [len(c) for c in chunks]  # (the table is split)
    for r in range(tp):
        torch.testing.assert_close(values[r], ref(tokens).chunk(tp, dim=1)[r], rtol=0, atol=0)
        torch.testing.assert_close(grad[r], ref.weight.grad, rtol=0, atol=0)
    assert backwards.rows and vocab not in backwards.rows, backwards.rows  # no rank filled the whole table


def test_a_middle_pipeline_stage_is_tensor_parallel_without_warnings() -> None:
    """A stage without the embedding, final norm and head gets the blocks' plan and no warning from
    torch for each end it does not hold (a pipelined TP run printed three per stage)."""
    cfg = resolved_config(None, ["--parallel.tp=2"])
    with simulate.simulated_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = split_stage(build_model(TINY_MODEL, device="meta"), [1], 3)  # (a middle stage of 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_tp(model, mesh, cfg.parallel)
    assert [str(w.message) for w in caught] == []
    block = next(iter(model.layers.values()))
    assert isinstance(block.attention.wq.weight, DTensor)  # (the blocks' plan ran)
