"""The collectives of one training step, per mesh dim, with their bytes -- derived from the layout
and the FSDP units, in the units ``--debug.comm`` measures (shardwise/observe/comm.py: each call's
largest tensor, the gathered tensor of an all-gather, the unreduced one of a reduce-scatter).

:func:`step_collectives` lists them in this order, one function per parallelism (named after its
file in shardwise/parallel/) and one for the per-step reductions. Per micro-batch (``micro_batches``
per step) of ``tokens = micro_batch * seq_len / cp`` tokens on a rank:

- **FSDP** (:func:`fsdp_collectives`; ``dp_shard x cp``; ``dp_shard x cp x tp`` for MoE routers
  and shared experts; ``efsdp`` for experts under EP): each unit's parameters all-gathered in
  forward and again in backward if it was resharded, its gradient reduce-scattered in the reduce
  dtype; under HSDP the sharded gradient is all-reduced over ``dp_replicate``. Pipeline ranks
  reduce once per step (torch's schedules turn gradient sync off for all but the last micro-batch).
- **Tensor/sequence parallel** (:func:`tensor_collectives`; ``tp``): around every attention and
  dense FFN an all-gather of the sequence-sharded input and a reduce-scatter of the output
  (``tokens x dim``), mirrored in backward; the vocab-parallel embedding (reduce-scatter) and head
  (all-gather); the norms' replicated weight gradients all-reduced; loss parallel's three
  per-token all-reduces (max, sum of exponentials, target logit) -- per chunk under
  ``training.loss_chunk``; without loss parallel, the logits gathered.
- **Context parallel** (:func:`context_collectives`; ``cp``): ring attention all-gathers each
  block's K and V in forward and backward and passes the K/V gradients around the ring
  (all-to-all) in backward; under document masks one all-gather of K and V in forward and one
  reduce-scatter of their gradients in backward.
- **Expert parallel** (:func:`expert_collectives`; ``ep``): per MoE block the routing counts and
  the routed tokens exchanged by all-to-all, both ways, forward and backward (and the balance
  loss's expert counts over ``cp x tp``). The token volume depends on routing; the model assumes
  balanced routing (the only estimate here that is not exact).
- **Pipeline** (:func:`pipeline_collectives`; ``pp``): each micro-batch's boundary activations
  sent forward and gradients back; the loss, gradient norm and MoE load shared between stages.
- **Per step** (:func:`step_reductions`): the global valid-token count and the loss over
  ``dp x cp``, the gradient norm's partial sums over each mesh dim the gradients are sharded on,
  the MoE token counts over ``dp x cp x tp``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from shardwise.config.model_args import ModelArgs
from shardwise.parallel.ac import recomputes_whole
from shardwise.parallel.dims import FLAT_VIEWS, MESH_DIMS, MOE_VIEWS, Degrees, Mesh
from shardwise.parallel.stages import rank_stages
from shardwise.plan.activations import Shape, shape_of
from shardwise.plan.states import BYTES, FsdpUnit, RankStates
from shardwise.resolve.run import ResolvedRun


@dataclass(frozen=True)
class Collective:
    group: str
    """Mesh dim (a ParallelDims name: dp_shard_cp, tp, cp, pp, dp_replicate, ep, efsdp, moe...)."""
    kind: str
    """all_gather, reduce_scatter, all_reduce, all_to_all, send, recv."""
    nbytes: int
    """Buffer bytes of one call."""
    calls: int
    phase: str
    """forward, backward or step."""
    what: str
    """Which mechanism issues it (for the report)."""
    overlap: str = "none"
    """What can hide it: ``fsdp`` (prefetched / reduced while other blocks compute), ``none``."""

    @property
    def total(self) -> int:
        return self.nbytes * self.calls


def _spanned_dims(group: str) -> tuple[str, ...]:
    """The base mesh dims a mesh dim named ``group`` spans (itself unless it is a flattened view)."""
    return FLAT_VIEWS.get(group) or MOE_VIEWS.get(group) or (group,)


@functools.lru_cache(maxsize=65536)
def group_members(degrees: Degrees, group: str, pp_rank: int = 0) -> frozenset[int]:
    """Ranks of the ``group`` mesh dim that contains the rank at pipeline coordinate ``pp_rank``
    and every other coordinate 0. Ranks are laid out pp, dp_replicate, dp_shard, cp, tp (outermost
    first); expert parallel takes the innermost ``ep`` of dp_shard x cp x tp, efsdp the rest."""
    base = pp_rank * (degrees.world // degrees.pp)
    if group in (Mesh.EP, Mesh.EFSDP):
        members = range(degrees.ep) if group == Mesh.EP else range(0, degrees.moe_shard, degrees.ep)
        return frozenset(base + r for r in members)
    dims = _spanned_dims(group)
    strides = {d: math.prod(getattr(degrees, x) for x in MESH_DIMS[MESH_DIMS.index(d) + 1:]) for d in dims}
    coords = itertools.product(*(range(getattr(degrees, d)) for d in dims))
    return frozenset(base + sum(c * strides[d] for c, d in zip(cs, dims, strict=True)) for cs in coords)


def group_size(degrees: Degrees, group: str) -> int:
    """Ranks in one ``group`` mesh dim."""
    if group == Mesh.EFSDP:
        return degrees.moe_shard // degrees.ep
    return math.prod(getattr(degrees, d) for d in _spanned_dims(group))


class _Issued:
    """The collectives one part of the step issues, in order. Drops those that do not happen: no
    calls, or a one-rank group -- FSDP and the DTensor styles skip collectives on one rank, while
    the trainer's own all-reduces (``size_one``) are issued even there."""

    def __init__(self, degrees: Degrees) -> None:
        self.degrees = degrees
        self.collectives: list[Collective] = []

    def add(self, group: str, kind: str, nbytes: int, calls: int, phase: str, what: str,
            overlap: str = "none", size_one: bool = False) -> None:
        if calls and (size_one or group_size(self.degrees, group) > 1):
            self.collectives.append(Collective(group, kind, int(nbytes), calls, phase, what, overlap))


def step_collectives(run: ResolvedRun, rank_states: RankStates) -> list[Collective]:
    """Every collective one steady-state step issues on the rank with states ``rank_states``
    (pipeline coordinate ``rank_states.pp_rank``, all others 0), in the module docstring's order."""
    shape = shape_of(run)
    parts = (fsdp_collectives, tensor_collectives, context_collectives, expert_collectives,
             pipeline_collectives, step_reductions)
    return [c for part in parts for c in part(run, rank_states, shape)]


def _moe_layers(shape: Shape, rank_states: RankStates) -> int:
    """How many of the rank's blocks are MoE blocks."""
    return sum(shape.args.is_moe_layer(i) for i in rank_states.layers)


def fsdp_reduce_bytes(run: ResolvedRun, shape: Shape) -> int:
    """Bytes per element of FSDP's gradient reduction: ``parallel.fsdp_reduce_dtype`` under bf16
    compute, fp32 under fp32 compute."""
    return BYTES[run.cfg.parallel.fsdp_reduce_dtype] if shape.e == 2 else 4


def fsdp_collectives(run: ResolvedRun, rank_states: RankStates,
                     shape: Shape) -> list[Collective]:
    """FSDP / HSDP: per unit, the parameter all-gathers, the gradient reduce-scatter and (HSDP) the
    sharded gradient's all-reduce over dp_replicate."""
    return [c for unit in rank_states.units for c in unit_collectives(run, unit, shape)]


def unit_collectives(run: ResolvedRun, unit: FsdpUnit, shape: Shape) -> list[Collective]:
    """One FSDP unit's collectives over the step (:func:`fsdp_collectives`), in the order it issues
    them: forward gather, backward gather (if resharded), reduce-scatter, HSDP all-reduce."""
    issued = _Issued(run.dims.degrees)
    micro_batches = run.micro_batches
    # Pipeline ranks keep their units gathered through the step (no reshard after forward) and
    # reduce once (the schedules sync gradients on the last micro-batch only).
    gathers, reductions = (1, 1) if run.dims.pp > 1 else (micro_batches, micro_batches)
    gather_bytes, reduce_buffer = shape.e * unit.numel, fsdp_reduce_bytes(run, shape) * unit.numel
    issued.add(unit.group, "all_gather", gather_bytes, gathers, "forward", "FSDP parameter all-gather",
               "fsdp")
    if unit.reshard and run.dims.pp == 1:
        issued.add(unit.group, "all_gather", gather_bytes, micro_batches, "backward",
                   "FSDP parameter all-gather", "fsdp")
    issued.add(unit.group, "reduce_scatter", reduce_buffer, reductions, "backward",
               "FSDP gradient reduce-scatter", "fsdp")
    issued.add(Mesh.DP_REPLICATE, "all_reduce", reduce_buffer // unit.shard, reductions, "backward",
               "HSDP gradient all-reduce", "fsdp")
    return issued.collectives


def tensor_collectives(run: ResolvedRun, rank_states: RankStates,
                       shape: Shape) -> list[Collective]:
    """Tensor/sequence parallel: the sequence-parallel gathers and reduce-scatters around every
    attention and dense FFN, the norms' weight gradients (QK-norm's too), the vocab-parallel embedding
    and head."""
    if run.dims.tp == 1:
        return []
    issued = _Issued(run.dims.degrees)
    add = issued.add
    micro_batches = run.micro_batches
    dim, n_layers = shape.args.dim, len(rank_states.layers)
    activation_bytes = shape.e * shape.tokens * dim  # one gathered (tokens x dim) activation
    # attention of every block, dense FFNs: gather in, reduce-scatter out; mirrored in backward
    regions = micro_batches * (n_layers + n_layers - _moe_layers(shape, rank_states))
    add(Mesh.TP, "all_gather", activation_bytes, regions, "forward", "sequence-parallel gather")
    add(Mesh.TP, "reduce_scatter", activation_bytes, regions, "forward", "sequence-parallel reduce-scatter")
    add(Mesh.TP, "reduce_scatter", activation_bytes, regions, "backward", "sequence-parallel gather (grad)")
    add(Mesh.TP, "all_gather", activation_bytes, regions, "backward",
        "sequence-parallel reduce-scatter (grad)")
    # A block recomputed in backward (full / layer checkpointing) gathers its attention's and dense
    # FFN's inputs again and reduce-scatters the attention's output (the FFN's feeds only the residual).
    again = [i for i in rank_states.layers if recomputes_whole(i, run.cfg.activation_checkpoint)]
    dense_again = sum(not shape.args.is_moe_layer(i) for i in again)
    add(Mesh.TP, "all_gather", activation_bytes, micro_batches * (len(again) + dense_again), "backward",
        "sequence-parallel gather (recompute)")
    add(Mesh.TP, "reduce_scatter", activation_bytes, micro_batches * len(again), "backward",
        "sequence-parallel reduce-scatter (recompute)")
    # The weights whole on every tp rank have their gradients summed over tp: per micro-batch, but
    # under pipeline parallel once per step, when the stage's accumulated gradients are reduced
    # (measured on real ranks and on simulated ones: tests/distributed/test_simulated.py).
    replicated = 1 if run.dims.pp > 1 else micro_batches
    add(Mesh.TP, "all_reduce", shape.e * dim, replicated * 2 * n_layers, "backward", "norm weight gradients")
    if shape.args.qk_norm:  # (per-head norms of every head's width)
        add(Mesh.TP, "all_reduce", shape.e * shape.args.head_dim, replicated * 2 * n_layers, "backward",
            "QK-norm weight gradients")
    for what, numel in latent_compressions(shape.args):  # whole on every rank, like the norms
        add(Mesh.TP, "all_reduce", shape.e * numel, replicated * n_layers, "backward",
            f"latent attention's {what} weight gradients")
    if rank_states.has_embedding:
        add(Mesh.TP, "reduce_scatter", activation_bytes, micro_batches, "forward", "vocab-parallel embedding")
        add(Mesh.TP, "all_gather", activation_bytes, micro_batches, "backward",
            "vocab-parallel embedding (grad)")
    if rank_states.has_head:
        add(Mesh.TP, "all_gather", activation_bytes, micro_batches, "forward", "output head input gather")
        add(Mesh.TP, "reduce_scatter", activation_bytes, micro_batches, "backward",
            "output head input gather (grad)")
        add(Mesh.TP, "all_reduce", shape.e * dim, replicated, "backward", "norm weight gradients")
        _tensor_loss(issued, run, shape, micro_batches)
    return issued.collectives


def latent_compressions(a: ModelArgs) -> list[tuple[str, int]]:
    """(name, elements) of latent attention's weights that stay whole on every tp rank (the
    compressions and their norms, models/mla.py); none for grouped-query attention."""
    if not a.mla:
        return []
    q = [("wq_a", a.dim * a.q_lora_rank), ("q_norm", a.q_lora_rank)] if a.q_lora_rank else []
    return [*q, ("wkv_a", a.dim * (a.kv_lora_rank + a.qk_rope_head_dim)), ("kv_norm", a.kv_lora_rank)]


def _tensor_loss(issued: _Issued, run: ResolvedRun, shape: Shape, micro_batches: int) -> None:
    """The loss over vocab-sharded logits: chunked, loss parallel, or the logits gathered."""
    tokens, chunk_tokens = shape.tokens, shape.loss_chunk
    if chunk_tokens:
        # per chunk of C tokens: the row max (C values), then the sum of exponentials and the
        # target logit (2C), fp32
        chunks, per_chunk = math.ceil(tokens / chunk_tokens), min(chunk_tokens, tokens)
        issued.add(Mesh.TP, "all_reduce", 4 * per_chunk, micro_batches * chunks, "forward",
                   "vocab-parallel chunked loss (max)")
        issued.add(Mesh.TP, "all_reduce", 8 * per_chunk, micro_batches * chunks, "forward",
                   "vocab-parallel chunked loss (sums)")
    elif run.cfg.parallel.loss_parallel:
        issued.add(Mesh.TP, "all_reduce", 4 * tokens, micro_batches * 3, "forward", "loss parallel")
    else:
        logits_bytes = shape.e * tokens * shape.args.vocab_size
        issued.add(Mesh.TP, "all_gather", logits_bytes, micro_batches, "forward", "logits gather")
        issued.add(Mesh.TP, "reduce_scatter", logits_bytes, micro_batches, "backward", "logits gather (grad)")


def context_collectives(run: ResolvedRun, rank_states: RankStates,
                        shape: Shape) -> list[Collective]:
    """Context parallel: ring attention's K/V exchange in forward and backward, and the K/V
    gradients' round in backward."""
    if run.dims.cp == 1 or not rank_states.layers:
        return []
    issued, args = _Issued(run.dims.degrees), shape.args
    # Ring attention (torch's templated ring): K and V travel around the cp ring -- one
    # all-gather, or cp - 1 point-to-point rotations (all-to-all) -- in forward and again in
    # backward, where the K/V gradients (fp32) make a full round in cp rotations.
    # (latent attention's keys and values travel expanded to every head, padded to one width)
    kv_heads = args.kv_heads // run.dims.tp
    local_kv_bytes = 2 * shape.e * run.micro_batch * kv_heads * shape.seq * args.kernel_head_dim
    attentions = run.micro_batches * len(rank_states.layers)
    if run.cfg.data.document_mask:
        # Document masks (parallel/context.py RingDocuments): K and V each all-gathered once in
        # forward (kept for backward), their gradients reduce-scattered once in backward.
        issued.add(Mesh.CP, "all_gather", run.dims.cp * local_kv_bytes // 2, 2 * attentions, "forward",
                   "document attention K/V")
        issued.add(Mesh.CP, "reduce_scatter", run.dims.cp * local_kv_bytes // 2, 2 * attentions, "backward",
                   "document attention K/V gradients")
        return issued.collectives
    for phase in ("forward", "backward"):
        if run.cfg.parallel.cp_rotate_method == "allgather":
            issued.add(Mesh.CP, "all_gather", run.dims.cp * local_kv_bytes, attentions, phase,
                       "ring attention K/V")
        else:
            issued.add(Mesh.CP, "all_to_all", local_kv_bytes, attentions * (run.dims.cp - 1), phase,
                       "ring attention K/V")
    issued.add(Mesh.CP, "all_to_all", local_kv_bytes * 4 // shape.e, attentions * run.dims.cp, "backward",
               "ring attention K/V gradients")
    return issued.collectives


def expert_collectives(run: ResolvedRun, rank_states: RankStates,
                       shape: Shape) -> list[Collective]:
    """MoE blocks: the balance loss's expert counts over cp x tp, and expert parallel's all-to-alls
    of the routing counts and the routed tokens (the busiest rank's: ``parallel.expert_load``)."""
    issued, args = _Issued(run.dims.degrees), shape.args
    moe_blocks = run.micro_batches * _moe_layers(shape, rank_states)
    if run.dims.cp * run.dims.tp > 1 and args.balance_loss:
        issued.add(Mesh.CP_TP, "all_reduce", 4 * run.micro_batch * (args.n_experts + 1), moe_blocks,
                   "forward", "MoE balance-loss counts")
    if run.dims.ep > 1:
        # what the busiest rank receives (its experts' share; as many as it sends when balanced)
        sent_bytes = round(shape.e * shape.norm_tokens * args.moe_top_k * args.dim * shape.ep_load)
        issued.add(Mesh.EP, "all_to_all", 8 * args.n_experts, moe_blocks, "forward", "expert-parallel counts")
        issued.add(Mesh.EP, "all_to_all", sent_bytes, 2 * moe_blocks, "forward", "expert-parallel tokens")
        issued.add(Mesh.EP, "all_to_all", sent_bytes, 2 * moe_blocks, "backward", "expert-parallel tokens")
    return issued.collectives


def pipeline_collectives(run: ResolvedRun, rank_states: RankStates,
                         shape: Shape) -> list[Collective]:
    """Pipeline parallel: boundary activations and gradients between stages on other ranks, and
    the per-step values shared by all stages."""
    if run.dims.pp == 1:
        return []
    issued = _Issued(run.dims.degrees)
    micro_batches = run.micro_batches
    pp_rank, n_stages = rank_states.pp_rank, run.dims.pp * run.stages_per_rank
    stages = rank_stages(pp_rank, run.dims.pp, run.pipeline.schedule, run.pipeline.interleaved)
    owner = {stage: rank for rank in range(run.dims.pp)
             for stage in rank_stages(rank, run.dims.pp, run.pipeline.schedule, run.pipeline.interleaved)}
    boundary = boundary_bytes(run, shape)
    sends = sum(1 for x in stages if x + 1 < n_stages and owner[x + 1] != pp_rank)
    recvs = sum(1 for x in stages if x > 0 and owner[x - 1] != pp_rank)
    issued.add(Mesh.PP, "send", boundary, micro_batches * sends, "forward", "pipeline activations")
    issued.add(Mesh.PP, "recv", boundary, micro_batches * recvs, "forward", "pipeline activations")
    issued.add(Mesh.PP, "send", boundary, micro_batches * recvs, "backward", "pipeline gradients")
    issued.add(Mesh.PP, "recv", boundary, micro_batches * sends, "backward", "pipeline gradients")
    issued.add(Mesh.PP, "all_reduce", 4, 1, "step", "loss to every stage")
    issued.add(Mesh.PP, "all_reduce", 8, 1, "step", "gradient norm")
    if shape.args.n_experts:
        issued.add(Mesh.PP, "all_reduce", 4, 1, "step", "MoE load")
    return issued.collectives


def boundary_bytes(run: ResolvedRun, shape: Shape) -> int:
    """Bytes a pipeline stage sends its neighbour per micro-batch: the residual stream,
    sequence-sharded over cp and tp (and the same again as its gradient, back)."""
    return shape.e * run.micro_batch * (run.local_seq // run.dims.tp) * shape.args.dim


def step_reductions(run: ResolvedRun, rank_states: RankStates,
                    shape: Shape) -> list[Collective]:
    """Once per step, issued even over one rank: valid tokens (int64) and the loss (fp32) over
    dp x cp, the gradient norm's partial sums (sharded gradients only), the MoE token counts."""
    issued, n_experts = _Issued(run.dims.degrees), shape.args.n_experts
    issued.add(Mesh.DP_CP, "all_reduce", 8, 1, "step", "valid-token count", size_one=True)
    issued.add(Mesh.DP_CP, "all_reduce", 4, 1, "step", "loss", size_one=True)
    if not rank_states.plain:  # (one rank without FSDP has no sharded gradients: no norm sums)
        for group, calls in _norm_groups(run.dims.degrees, rank_states, n_experts > 0).items():
            issued.add(group, "all_reduce", 8, calls, "step", "gradient norm", size_one=True)
    if moe_layers := _moe_layers(shape, rank_states):
        issued.add(Mesh.DP_CP_TP, "all_reduce", 4 * moe_layers * n_experts, 1, "step", "MoE token counts",
                   size_one=True)
    return issued.collectives


def _norm_groups(degrees: Degrees, rank_states: RankStates, moe: bool) -> dict[str, int]:
    """All-reduces of the gradient norm's partial sums: one per (parameter mesh, sharded dims)
    group per sharded dim (shardwise/optim/clip.py)."""
    calls: dict[str, int] = {}

    def count(*groups: str) -> None:
        for group in groups:
            calls[group] = calls.get(group, 0) + 1

    unit_groups = {unit.group for unit in rank_states.units}
    fsdp = Mesh.DP_SHARD_CP
    if degrees.tp > 1:
        count(fsdp, Mesh.TP)  # tensor-parallel weights: sharded on FSDP's dim and tp
    count(fsdp)  # norms (and everything without TP)
    if moe and Mesh.MOE in unit_groups:
        count(Mesh.MOE)
    if Mesh.EFSDP in unit_groups:
        count(Mesh.EFSDP, Mesh.EP)
    return calls


def totals(colls: list[Collective]) -> dict[str, dict[str, int]]:
    """Bytes per (mesh dim, collective) over the step, like comm.json's totals."""
    out: dict[str, dict[str, int]] = {}
    for c in colls:
        per = out.setdefault(c.group, {})
        per[c.kind] = per.get(c.kind, 0) + c.total
    return out
