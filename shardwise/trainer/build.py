"""This rank's model and what feeds it, from the resolved run: the stages it holds (pipeline
parallel), the model built on meta, parallelized, materialized and initialized, the pipeline
schedule, and the context-parallel cut of each batch. The trainer and the planner (which builds the
same model on a fake world to read its states) both use these."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from shardwise.data.dataset import IGNORE_INDEX, Batch
from shardwise.models.lora import apply_lora, check_frozen
from shardwise.models.transformer import build_model, init_weights
from shardwise.parallel.context import shard_sequences
from shardwise.parallel.dims import Mesh, ParallelDims
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline import Pipe, attach_stage_views, split_stage
from shardwise.parallel.stages import rank_stages
from shardwise.resolve.run import ResolvedRun
from shardwise.trainer import simulate
from shardwise.trainer.loss import token_loss_sum


def build_rank_model(run: ResolvedRun, device: torch.device | str) -> nn.Module:
    """This rank's model, ready to train: 1) on meta (this rank's pipeline stages) -> 2) parallelized
    -> 3) materialized on ``device`` -> 4) initialized from the run seed. ``run.dims`` has its mesh."""
    model = build_stage(run)
    if run.model.n_experts:
        # The MoE views are process groups: every rank makes them, in the same order, whether or not
        # its pipeline stage holds experts (parallelize() makes them only where it does).
        run.dims.moe_meshes()
    parallelize(model, run.dims, run.cfg, run.compile)
    if run.cfg.lora.rank:
        check_frozen(model)
    model.to_empty(device=device)
    simulate.adapt(model)  # simulated ranks (verify --ranks) only: see trainer/simulate.py
    init_weights(model, run.cfg.training.seed)
    return model


def build_stage(run: ResolvedRun) -> nn.Module:
    """The model on meta, or with pipeline parallel only this rank's stages of it (one module)."""
    dims, pc = run.dims, run.cfg.parallel
    # A sequence's tokens are split over cp x tp: the MoE balance loss counts over those ranks
    # (sequence-wise), or over every rank that routes other tokens, dp x cp x tp (batch-wise).
    group = dims.submesh(Mesh.CP_TP).get_group() if dims.cp * dims.tp > 1 else None
    batch = dims.submesh(Mesh.DP_CP_TP).get_group() if dims.dp * dims.cp * dims.tp > 1 else None
    model = build_model(run.model, sequences_per_step=run.cfg.training.global_batch, sequence_group=group,
                        batch_group=batch)
    if run.cfg.lora.rank:  # (the whole model: a pipeline stage's adapters keep the full model's names)
        apply_lora(model, run.cfg.lora)
    if dims.pp == 1:
        return model
    ids = rank_stages(dims.submesh(Mesh.PP).get_local_rank(), dims.pp, pc.pp_schedule, pc.pp_stages_per_rank)
    part = split_stage(model, ids, dims.pp * len(ids))
    attach_stage_views(part, ids, dims.pp * len(ids))
    return part


def build_pipe(model: nn.Module, run: ResolvedRun, device: torch.device) -> Pipe | None:
    """The pipeline schedule over this rank's stages (None without pipeline parallel)."""
    dims, pc = run.dims, run.cfg.parallel
    if dims.pp == 1:
        return None
    # Loss parallel's backward must run inside its context, and the schedule runs the backward.
    ctx = loss_parallel if dims.tp > 1 and pc.loss_parallel else contextlib.nullcontext
    return Pipe(model, dims.submesh(Mesh.PP), device, pc.pp_schedule, run.micro_batches, token_loss_sum, ctx,
                pc.pp_stages_per_rank)


def batch_sharder(dims: ParallelDims, load_balance: bool) -> Callable[[list[Batch]], list[Batch]]:
    """Identity, or under context parallel: each micro-batch cut to this cp rank's positions."""
    if dims.cp == 1:
        return list
    mesh = dims.submesh(Mesh.CP)

    def shard(batches: list[Batch]) -> list[Batch]:
        out = []
        for b in batches:
            inputs, labels = shard_sequences(mesh, [b.inputs, b.labels], load_balance)  # (B, S/cp)
            # Document ids stay whole (B, S): each rank's queries see keys of the whole window.
            out.append(Batch(inputs, labels, b.doc_ids, int((labels != IGNORE_INDEX).sum()), b.first_row))
        return out
    return shard
