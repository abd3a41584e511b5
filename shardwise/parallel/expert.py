"""Expert parallel for MoE blocks: the experts split over ``ep`` ranks, tokens exchanged by
uneven all-to-all.

Each of the ``ep`` ranks of a group owns ``n_experts / ep`` whole experts (the 3-D expert weights
are DTensors sharded on the expert dim). After routing, every rank has its routing slots sorted by
expert; :class:`ExpertParallel` wraps the experts module so that

1. the per-expert counts are exchanged (all-to-all of ``n_experts`` integers), which tells every
   rank how many slots it sends to and receives from each peer;
2. the slots travel to the ranks owning their experts (uneven ``all_to_all_single``, autograd);
3. the received slots -- grouped by source rank, then expert -- are reordered expert-major and
   the local experts run as one grouped GEMM;
4. the outputs go back the reverse way, so the MoE layer combines them exactly as without EP.

``ep`` borrows ranks from ``dp_shard x cp x tp``: for an MoE block all of those ranks hold different
tokens (the block runs on tensor-parallel ranks' sequence shards, not on gathered copies), so any of
them can serve as expert-parallel peers. FSDP then shards each expert further over the remaining
``dp_shard*cp*tp / ep`` ranks (and replicates over ``dp_replicate``); the router and shared expert
are sharded over all ``dp_shard*cp*tp`` ranks like a data-parallel module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from shardwise.models.protocol import blocks


class ExpertParallel:
    """Shards a block's grouped experts (``block.plan.experts``: every parameter's dim 0 is the expert,
    ``forward(x, counts)``) over a 1-D ``ep`` mesh and moves tokens to their experts."""

    def __init__(self) -> None:
        self.perm: torch.Tensor | None = None
        self.send: list[int] = []
        self.recv: list[int] = []

    def apply(self, experts: nn.Module, mesh: DeviceMesh) -> None:
        distribute_module(experts, mesh, self._partition, self._dispatch, self._combine)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            # (requires_grad kept: LoRA's frozen experts stay frozen)
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                                          requires_grad=p.requires_grad))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs  # (N, dim) sorted by expert, (E,) slots per expert
        group, ep = mesh.get_group(), mesh.size()
        n_local = counts.numel() // ep
        with torch.no_grad():
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=group)  # (ep * n_local,) by source
            by_source = recv_counts.view(ep, n_local)
            # One host sync: the split sizes are needed as Python ints.
            sizes = torch.stack([counts.view(ep, n_local).sum(1), by_source.sum(1)]).tolist()
            self.send, self.recv = sizes
            # Received rows come grouped (source, local expert); the grouped GEMM wants expert-major.
            expert_of_row = torch.arange(n_local, device=x.device).repeat(ep).repeat_interleave(
                by_source.flatten())
            self.perm = torch.argsort(expert_of_row, stable=True)
        x = funcol.all_to_all_single_autograd(x.contiguous(), self.recv, self.send, group)
        return x.index_select(0, self.perm), by_source.sum(0)  # (N_recv, dim) expert-major, (n_local,)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        restored = out.index_select(0, torch.argsort(self.perm))  # back to (source, expert) order
        return funcol.all_to_all_single_autograd(restored, self.send, self.recv, mesh.get_group())


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every block's grouped experts over the 1-D ``ep`` mesh (before FSDP)."""
    for block in blocks(model):
        if block.plan.experts:
            ExpertParallel().apply(block.get_submodule(block.plan.experts), mesh)
