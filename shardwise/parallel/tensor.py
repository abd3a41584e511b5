"""Tensor + sequence parallel, with loss parallel, on DTensor, as each model's plan declares it.

Megatron-style TP (Shoeybi et al., 2019) with sequence parallel (Korthikanti et al., 2022): the
residual stream between blocks stays sharded along the sequence (``Shard(1)``), so norms run on
``S/tp`` tokens each. Entering attention or the MLP, the activations are all-gathered (over tp);
Q/K/V and w1/w3 are column-parallel (each rank owns whole heads / a slice of the hidden dim); wo and
w2 are row-parallel and reduce-scatter their output back to sequence shards.

With ``parallel.loss_parallel`` the output head stays column-parallel (vocab-sharded logits,
``Shard(-1)``) and the cross-entropy runs under ``loss_parallel()``: no rank ever holds the full
logits. The trainer enters that context whenever the logits arrive as a DTensor.

Groups converted to float8 (shardwise/parallel/float8.py) take torchao's float8 styles: the input is
cast to float8 on its sequence shard, with the amax reduced over tp, and all-gathered in float8.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.config.schema import ParallelConfig
from shardwise.models.protocol import blocks
from shardwise.parallel.float8 import tp_styles


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s global value (a loss-parallel loss is a replicated DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def apply_tp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    """Shard ``model`` over the 1-D ``tp`` mesh in place (call before FSDP), as its plans say
    (``model.plan``, ``block.plan``: shardwise/models/protocol.py)."""
    if cfg.async_tp:
        enable_async_tp(mesh)
    float8_comm = dist.get_backend(mesh.get_group()) != "gloo"  # gloo has no float8 dtypes
    ends = model.plan
    head = own_style(getattr(model, ends.head, None), "colwise", ColwiseParallel)
    styles = {
        # Vocab-sharded lookup; the partial sums are reduce-scattered into sequence shards.
        ends.embedding: VocabParallelLookup(input_layouts=Replicate(), output_layouts=Shard(1)),
        ends.norm: SequenceParallel(),
        ends.head: head(input_layouts=Shard(1),
                        output_layouts=Shard(-1) if cfg.loss_parallel else Replicate(),
                        use_local_output=not cfg.loss_parallel),
    }
    # (a pipeline stage holds the ends it runs, the others are None: torch warns about each absent key)
    # torch's SequenceParallel re-creates a norm's weight as a trainable Parameter: a frozen one
    # (LoRA's base) is frozen again after
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, mesh, {k: v for k, v in styles.items() if getattr(model, k, None) is not None})
    for block in blocks(model):
        parallelize_module(block, mesh, block_tp_plan(block, float8_comm))
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)


def block_tp_plan(block: nn.Module, float8_comm: bool) -> dict[str, ParallelStyle]:
    """torch's parallel styles for one block, from its :class:`~shardwise.models.protocol.BlockPlan`."""
    plan = block.plan
    styles: dict[str, ParallelStyle] = {norm: SequenceParallel() for norm in plan.sequence_norms}
    for region in plan.local:
        # Stays on the sequence shard: each tp rank processes its own S/tp tokens (no gather), its
        # weights are not split over tp -- FSDP shards them over dp_shard x cp x tp instead and sums
        # their gradients over all of those ranks. The output is the local shard, as the residual
        # stream between blocks is.
        styles[region] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                            use_local_output=True)
    for group in (g for g in plan.groups if g.split):
        parent = block.get_submodule(group.region)
        col, row, prepare = tp_styles(parent, group.columns[0], float8_comm)
        # gather the hidden states over the sequence (all-gather over tp); the region's other
        # inputs (RoPE table, document mask) are plain tensors, the same on every rank
        rest = (None,) * (group.inputs - 1)
        styles[group.region] = prepare(input_layouts=(Shard(1), *rest),
                                       desired_input_layouts=(Replicate(), *rest))
        styles.update({f"{group.region}.{n}": own_style(parent.get_submodule(n), "colwise", col)()
                       for n in group.columns})
        # reduce-scatter over tp, back into sequence shards
        styles.update({f"{group.region}.{n}": own_style(parent.get_submodule(n), "rowwise", row)(
            output_layouts=Shard(1)) for n in group.rows})
        styles.update({f"{group.region}.{n}": Replicated() for n in group.replicated})
        styles.update({f"{group.region}.{n}": SharedByHeads() for n in group.shared})
    # Per-head norms run on this rank's heads (dim 2 of (B, S, H/tp, D)): the weight is replicated
    # and its gradient, a partial sum over the local heads, is summed over tp.
    styles.update({norm: SequenceParallel(sequence_dim=2, use_local_output=True) for norm in plan.head_norms})
    return styles


def own_style(linear: nn.Module | None, kind: str, default: type) -> type:
    """The ``kind`` ("colwise" / "rowwise") TP style ``linear`` declares for itself
    (models/protocol.py: LoRA's adapted linears), else ``default``."""
    return getattr(type(linear), f"{kind}_style", None) or default


class VocabParallelLookup(RowwiseParallel):
    """torch's row-wise embedding (the table split by vocabulary over tp, each rank's rows the
    partial sum of the lookup, reduce-scattered into sequence shards) whose backward fills only this
    rank's rows. DTensor's own lookup has no vocab-sharded rule for the embedding's backward: every
    rank computes the whole table's gradient (vocab x dim: 4.2 GB in bf16 for Llama 3 405B) and
    keeps its slice. Here each rank looks up its rows locally, tokens outside them reading zeros, so
    autograd's backward writes its ``vocab/tp`` rows only; forward values and gradients are the same
    (tests/unit/test_tp_lookup.py)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        # an instance attribute: nn.Module calls it in place of the class's forward
        module.forward = functools.partial(_vocab_lookup, module)
        return module


def _vocab_lookup(module: nn.Embedding, tokens: torch.Tensor) -> DTensor:
    weight = module.weight  # a DTensor, rows [start, start + rows) of the vocabulary on this rank
    mesh = weight.device_mesh
    local = tokens.to_local() if isinstance(tokens, DTensor) else tokens  # (B, S), every rank's
    (rows, _), (start, _) = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    outside, ids = _local_ids(local, start, rows)
    found = F.embedding(ids, weight.to_local()).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, S, dim)
    return DTensor.from_local(found, mesh, (Partial(),), run_check=False)


@maybe_run_for_local_tensor  # (rank-dependent: torch runs it per simulated rank, as DTensor's own lookup)
def _local_ids(tokens: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens fall outside this rank's rows, and every token's row here (0 where outside)."""
    outside = (tokens < start) | (tokens >= start + rows)
    return outside, (tokens - start).masked_fill(outside, 0)


class Replicated(ParallelStyle):
    """A module inside a split region whose weights are whole on every tp rank (MLA's low-rank
    compressions): it runs on the gathered input, its output is a replicated DTensor, and the
    weight gradients -- partial sums, since each rank's heads use the output -- are summed over tp
    by DTensor. (torch has no style for this; torchtitan writes the same one as ``NoParallel``.)"""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=_replicated_inputs)


def _replicated_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


class SharedByHeads(ParallelStyle):
    """A module whose replicated input is read by this rank's heads only (MLA's RoPE key, shared by
    every head): the input becomes a plain tensor whose gradient is a partial sum over tp, which
    the replicated layers before it (a DTensor ``Partial``) sum."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=_head_local_inputs)


def _head_local_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(x.to_local(grad_placements=(Partial(),)) if isinstance(x, DTensor) else x for x in inputs)


def enable_async_tp(mesh: DeviceMesh) -> None:
    """torch's micro-pipelined TP: inductor rewrites each all-gather -> matmul and matmul ->
    reduce-scatter of the compiled blocks into chunked collectives over symmetric memory that
    overlap the matmul's chunks (torch._inductor.config._micro_pipeline_tp). Older torch needs the
    TP group registered for symmetric memory; 2.13 does it by itself and deprecates the call.
    Checked before (resolve.check_async_tp): CUDA, NCCL, compile. Written, not yet run on a GPU."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    inductor_config._micro_pipeline_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (deprecated where not needed)
            enable(mesh.get_group().group_name)


def emulate_tp_rounding(model: nn.Module, tp: int) -> None:
    """On one rank, make every linear layer tensor parallel would split compute as ``tp`` ranks do,
    the same math rounded in the same places: a row-parallel layer as ``tp`` partial products over
    slices of its input, summed in the compute dtype (what the reduce-scatter adds), a column-parallel
    one (the output head too, where the loss calls it) as ``tp`` slices of its output, so that its
    input's gradient is summed from ``tp`` partial products as TP's backward reduction sums them.
    ``verify``'s noise floor runs this (``debug.tp_rounding``): a TP layout's own bf16 rounding,
    sampled without TP (tests/e2e/test_verify.py holds a step's outputs and gradients to tp=2's)."""
    if type(head := getattr(model, model.plan.head, None)) is nn.Linear:
        _split(head, tp, rows=False)
    for block in blocks(model):
        for group in (g for g in block.plan.groups if g.split):
            for names, rows in ((group.columns, False), (group.rows, True)):
                for name in names:
                    module = block.get_submodule(f"{group.region}.{name}")
                    if type(module) is nn.Linear:  # (a float8 layer, a subclass, keeps its own)
                        _split(module, tp, rows)


def _split(module: nn.Linear, tp: int, rows: bool) -> None:
    # an instance attribute: nn.Module calls it in place of the class's forward
    module.forward = functools.partial(_row_parallel if rows else _column_parallel, module, tp)


def _row_parallel(module: nn.Linear, tp: int, x: torch.Tensor) -> torch.Tensor:
    k = module.in_features // tp
    # (contiguous slices: each partial product's operands laid out as on its tp rank)
    parts = (slice(r * k, (r + 1) * k) for r in range(tp))
    out = sum(F.linear(x[..., p].contiguous(), module.weight[:, p].contiguous()) for p in parts)
    return out if module.bias is None else out + module.bias


def _column_parallel(module: nn.Linear, tp: int, x: torch.Tensor) -> torch.Tensor:
    n = module.out_features // tp
    return torch.cat([F.linear(x, module.weight[r * n:(r + 1) * n],
                               None if module.bias is None else module.bias[r * n:(r + 1) * n])
                      for r in range(tp)], dim=-1)
