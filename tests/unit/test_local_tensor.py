"""Many ranks simulated in one process (torch's ``torch.distributed._local_tensor``, a private module:
its behaviour is pinned here, issue #84's groundwork): shardwise's own init and tensor-parallel plan
run on simulated ranks and compute what one rank does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.models.transformer import build_model, init_weights
from shardwise.parallel.tensor import apply_tp
from tests.helpers import TINY_MODEL, resolved_config


def _rank0(t: torch.Tensor) -> torch.Tensor:
    """A simulated tensor's value on rank 0 (a DTensor gathered first)."""
    from torch.distributed._local_tensor import LocalTensor

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t._local_tensors[0] if isinstance(t, LocalTensor) else t


def test_tensor_parallel_on_simulated_ranks_computes_what_one_rank_does():
    """The tiny model under TP over 2 simulated ranks (meta -> apply_tp -> materialize -> init, as the
    trainer builds it): logits and every parameter's gradient equal the one-rank model's (fp32), and
    the weights really are sharded (each simulated rank holds half of a column-parallel weight)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    ranks = 2
    ref = build_model(TINY_MODEL, device="cpu")
    init_weights(ref, 0)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref_out = ref(tokens)
    ref_grads = dict(zip([n for n, _ in ref.named_parameters()],
                         torch.autograd.grad(ref_out.square().mean(), list(ref.parameters())), strict=True))
    cfg = resolved_config(None, [f"--parallel.tp={ranks}", "--parallel.loss_parallel=false"])
    dist.init_process_group("fake", rank=0, world_size=ranks)
    try:
        with LocalTensorMode(frozenset(range(ranks))):
            mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
            model = build_model(TINY_MODEL, device="meta")
            apply_tp(model, mesh, cfg.parallel)
            model.to_empty(device="cpu")
            init_weights(model, 0)
            wq = model.layers["0"].attention.wq.weight
            assert wq.to_local()._local_tensors[1].shape[0] == wq.shape[0] // ranks
            out = model(tokens)
            names = [n for n, _ in model.named_parameters()]
            grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
            got = {n: _rank0(g) for n, g in zip(names, grads, strict=True)}
            logits = _rank0(out)
    finally:
        from torch.distributed.tensor import _random

        dist.destroy_process_group()
        _random._rng_tracker = None  # (the simulation's RNG tracker, as DTensor's own tests reset it)
    torch.testing.assert_close(logits, ref_out, atol=1e-5, rtol=1e-5)
    assert got.keys() == ref_grads.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
