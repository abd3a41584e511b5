"""Vocab-parallel chunked linear + cross-entropy (tensor parallel) against F.cross_entropy on the
full materialized logits in one process: loss and gradients of hidden states and weight, every
reduction, ignored tokens, uneven chunks, hidden states sequence-sharded (SP) or replicated."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from shardwise.ops.chunked_ce import chunked_linear_cross_entropy, reference_linear_cross_entropy
from tests.helpers import free_port

pytestmark = pytest.mark.dist
WORLD = 2
IGNORE = -100


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, s, d, v = 2, 12, 16, 37  # 37 rows split 19 + 18: uneven vocabulary shards
    hidden = torch.randn(b, s, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, :3] = IGNORE
    labels[1, 5] = v - 1  # a target in the last (shorter) shard
    return hidden, weight, labels


def _worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            hidden, weight, labels = _inputs(dtype)
            for reduction in ("sum", "mean", "none"):
                up = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                ref = reference_linear_cross_entropy(h.double(), w.double(), labels, reduction,
                                                     ignore_index=IGNORE)
                (ref * (up.double() if reduction == "none" else 1)).sum().backward()
                # The plain computation in this dtype: its distance from float64 bounds ours.
                hp, wp = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                plain = reference_linear_cross_entropy(hp, wp, labels, reduction, ignore_index=IGNORE)
                (plain * (up.to(plain.dtype) if reduction == "none" else 1)).sum().backward()
                plain_errs = [(plain.double() - ref.detach()).abs().max().item(),
                              (hp.grad.double() - h.grad).abs().max().item(),
                              (wp.grad.double() - w.grad).abs().max().item()]
                for placement in ("sequence", "replicated"):
                    dw = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
                    dh = distribute_tensor(hidden.clone(), mesh,
                                           [Shard(1) if placement == "sequence" else Replicate()])
                    dh.requires_grad_()
                    loss = chunked_linear_cross_entropy(dh, dw, labels, reduction, IGNORE, chunk_size=5)
                    (loss * (up.to(loss.dtype) if reduction == "none" else 1)).sum().backward()
                    grad_h = dh.grad.full_tensor() if isinstance(dh.grad, DTensor) else dh.grad
                    errs = [(loss.double() - ref.detach()).abs().max().item(),
                            (grad_h.double() - h.grad).abs().max().item(),
                            (dw.grad.full_tensor().double() - w.grad).abs().max().item()]
                    out[str(dtype), reduction, placement] = (errs, plain_errs)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_matches_full_logits():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        for (dtype, reduction, placement), (errs, plain_errs) in results[rank].items():
            for err, plain_err in zip(errs, plain_errs, strict=True):
                if "float32" in dtype:  # summation order only
                    assert err < 2e-5, (rank, dtype, reduction, placement, errs)
                else:  # bf16: within 2x the plain bf16 computation's own error (as single-device)
                    assert err <= 2 * plain_err + 1e-6, (rank, dtype, reduction, placement, errs, plain_errs)
