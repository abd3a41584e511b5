"""The collectives of one training step, per mesh dim, with their bytes -- derived from the layout
and the FSDP units, in the units ``--debug.comm`` measures (shardwise/observe/comm.py: each call's
largest tensor, the gathered tensor of an all-gather, the unreduced one of a reduce-scatter).

Per micro-batch ``m`` of ``T = micro_batch * seq_len / cp`` tokens on a rank:

- **FSDP** (``dp_shard x cp``; ``dp_shard x cp x tp`` for MoE routers and shared experts; ``efsdp``
  for experts under EP): each unit's parameters all-gathered in forward and again in backward if
  it was resharded, its gradient reduce-scattered in the reduce dtype; under HSDP the sharded
  gradient is all-reduced over ``dp_replicate``. Pipeline ranks reduce once per step (torch's
  schedules turn gradient sync off for all but the last micro-batch).
- **Tensor/sequence parallel** (``tp``): around every attention and dense FFN an all-gather of the
  sequence-sharded input and a reduce-scatter of the output (``T x dim``), mirrored in backward;
  the vocab-parallel embedding (reduce-scatter) and head (all-gather); the norms' replicated weight
  gradients all-reduced; loss parallel's three per-token all-reduces (max, sum of exponentials,
  target logit).
- **Context parallel** (``cp``): ring attention all-gathers each block's K and V in forward and
  backward and passes the K/V gradients around the ring (all-to-all) in backward.
- **Pipeline** (``pp``): each micro-batch's boundary activations sent forward and gradients back.
- **Expert parallel** (``ep``): per MoE block the routing counts and the routed tokens exchanged by
  all-to-all, both ways, forward and backward. The token volume depends on routing; the model
  assumes balanced routing (the only estimate here that is not exact).
- **Per step**: the global valid-token count and the loss over ``dp x cp``, the gradient norm's
  partial sums over each mesh dim the gradients are sharded on (and over ``pp``), the MoE
  token counts over ``dp x cp x tp``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from shardwise.config import Config
from shardwise.models import model_args
from shardwise.plan.layout import Layout
from shardwise.plan.memory import shape_of
from shardwise.plan.states import BYTES, RankStates

# Mesh dim names (as ``ParallelDims`` names its meshes) -> the base dims they flatten.
FLAT = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"), "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
        "cp_tp": ("cp", "tp"), "dp_shard_cp_tp": ("dp_shard", "cp", "tp"), "moe": ("dp_shard", "cp", "tp")}
ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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


@functools.lru_cache(maxsize=65536)
def group_members(layout: Layout, group: str, pp_rank: int = 0) -> frozenset[int]:
    """Ranks of the ``group`` mesh dim that contains the rank at pipeline coordinate ``pp_rank``
    and every other coordinate 0. Ranks are laid out pp, dp_replicate, dp_shard, cp, tp (outermost
    first); expert parallel takes the innermost ``ep`` of dp_shard x cp x tp, efsdp the rest."""
    base = pp_rank * (layout.world // layout.pp)
    if group in ("ep", "efsdp"):
        inner = layout.dp_shard * layout.cp * layout.tp
        members = range(layout.ep) if group == "ep" else range(0, inner, layout.ep)
        return frozenset(base + r for r in members)
    dims = FLAT.get(group, (group,))
    strides = {d: math.prod(getattr(layout, o) for o in ORDER[ORDER.index(d) + 1:]) for d in dims}
    coords = itertools.product(*(range(getattr(layout, d)) for d in dims))
    return frozenset(base + sum(c * strides[d] for c, d in zip(cs, dims, strict=True)) for cs in coords)


def group_size(layout: Layout, group: str) -> int:
    if group == "efsdp":
        return layout.dp_shard * layout.cp * layout.tp // layout.ep
    return math.prod(getattr(layout, d) for d in FLAT.get(group, (group,)))


def step_collectives(cfg: Config, layout: Layout, st: RankStates) -> list[Collective]:
    """Every collective one steady-state step issues on the rank with states ``st`` (pipeline
    coordinate ``st.pp_rank``, all others 0)."""
    args, s = model_args(cfg.model), shape_of(cfg, layout)
    e = s.e
    red = BYTES[cfg.parallel.fsdp_reduce_dtype] if e == 2 else 4
    m = layout.micro_batches(cfg.training.global_batch)
    out: list[Collective] = []

    def add(group: str, kind: str, nbytes: int, calls: int, phase: str, what: str,
            overlap: str = "none", size_one: bool = False) -> None:
        """``size_one``: issued even over a one-rank group (the trainer's own all-reduces are;
        FSDP and the DTensor styles skip collectives on one rank)."""
        if calls and (size_one or group_size(layout, group) > 1):
            out.append(Collective(group, kind, int(nbytes), calls, phase, what, overlap))

    # FSDP / HSDP. Pipeline ranks keep their units gathered through the step (no reshard after
    # forward) and reduce once (the schedules sync gradients on the last micro-batch only).
    gathers, reductions = (1, 1) if layout.pp > 1 else (m, m)
    for u in st.units:
        add(u.group, "all_gather", e * u.numel, gathers, "forward", "FSDP parameter all-gather", "fsdp")
        if u.reshard and layout.pp == 1:
            add(u.group, "all_gather", e * u.numel, m, "backward", "FSDP parameter all-gather", "fsdp")
        add(u.group, "reduce_scatter", red * u.numel, reductions, "backward",
            "FSDP gradient reduce-scatter", "fsdp")
        add("dp_replicate", "all_reduce", red * u.numel // u.shard, reductions, "backward",
            "HSDP gradient all-reduce", "fsdp")

    t, d = s.tokens, args.dim
    n_moe = sum(args.is_moe_layer(i) for i in st.layers)
    n_dense = len(st.layers) - n_moe
    if layout.tp > 1:
        act = e * t * d
        # attention of every block, dense FFNs: gather in, reduce-scatter out; mirrored in backward
        n_regions = len(st.layers) + n_dense
        add("tp", "all_gather", act, m * n_regions, "forward", "sequence-parallel gather")
        add("tp", "reduce_scatter", act, m * n_regions, "forward", "sequence-parallel reduce-scatter")
        add("tp", "reduce_scatter", act, m * n_regions, "backward", "sequence-parallel gather (grad)")
        add("tp", "all_gather", act, m * n_regions, "backward", "sequence-parallel reduce-scatter (grad)")
        add("tp", "all_reduce", e * d, m * 2 * len(st.layers), "backward", "norm weight gradients")
        if st.has_embedding:
            add("tp", "reduce_scatter", act, m, "forward", "vocab-parallel embedding")
            add("tp", "all_gather", act, m, "backward", "vocab-parallel embedding (grad)")
        if st.has_head:
            add("tp", "all_gather", act, m, "forward", "output head input gather")
            add("tp", "reduce_scatter", act, m, "backward", "output head input gather (grad)")
            add("tp", "all_reduce", e * d, m, "backward", "norm weight gradients")
            if cfg.training.loss_chunk:
                # per chunk of C tokens: the row max (C values), then the sum of exponentials
                # and the target logit (2C), fp32
                chunks, c = math.ceil(t / cfg.training.loss_chunk), min(cfg.training.loss_chunk, t)
                add("tp", "all_reduce", 4 * c, m * chunks, "forward", "vocab-parallel chunked loss (max)")
                add("tp", "all_reduce", 8 * c, m * chunks, "forward", "vocab-parallel chunked loss (sums)")
            elif cfg.parallel.loss_parallel:
                add("tp", "all_reduce", 4 * t, m * 3, "forward", "loss parallel")
            else:
                add("tp", "all_gather", e * t * args.vocab_size, m, "forward", "logits gather")
                add("tp", "reduce_scatter", e * t * args.vocab_size, m, "backward", "logits gather (grad)")
    if layout.cp > 1 and st.layers:
        # Ring attention (torch's templated ring): K and V travel around the cp ring -- one
        # all-gather, or cp - 1 point-to-point rotations (all-to-all) -- in forward and again in
        # backward, where the K/V gradients (fp32) make a full round in cp rotations.
        local_kv = 2 * e * layout.micro_batch * (args.n_kv_heads // layout.tp) * s.seq * args.head_dim
        n = m * len(st.layers)
        for phase in ("forward", "backward"):
            if cfg.parallel.cp_rotate_method == "allgather":
                add("cp", "all_gather", layout.cp * local_kv, n, phase, "ring attention K/V")
            else:
                add("cp", "all_to_all", local_kv, n * (layout.cp - 1), phase, "ring attention K/V")
        add("cp", "all_to_all", local_kv * 4 // e, n * layout.cp, "backward", "ring attention K/V gradients")
    if n_moe and layout.cp * layout.tp > 1 and args.moe_balance == "aux_loss" and args.moe_aux_coef > 0:
        add("cp_tp", "all_reduce", 4 * layout.micro_batch * (args.n_experts + 1), m * n_moe, "forward",
            "MoE balance-loss counts")
    if n_moe and layout.ep > 1:
        slots = e * s.norm_tokens * args.moe_top_k * d  # balanced routing: what a rank sends
        add("ep", "all_to_all", 8 * args.n_experts, m * n_moe, "forward", "expert-parallel counts")
        add("ep", "all_to_all", slots, 2 * m * n_moe, "forward", "expert-parallel tokens")
        add("ep", "all_to_all", slots, 2 * m * n_moe, "backward", "expert-parallel tokens")
    if layout.pp > 1:
        n_stages = layout.pp * layout.stages_per_rank
        from shardwise.parallel.pipeline import rank_stages

        stages = rank_stages(st.pp_rank, layout.pp, layout.pp_schedule, layout.pp_stages_per_rank)
        owner = {x: r for r in range(layout.pp)
                 for x in rank_stages(r, layout.pp, layout.pp_schedule, layout.pp_stages_per_rank)}
        boundary = e * layout.micro_batch * (cfg.training.seq_len // layout.cp // layout.tp) * d
        sends = sum(1 for x in stages if x + 1 < n_stages and owner[x + 1] != st.pp_rank)
        recvs = sum(1 for x in stages if x > 0 and owner[x - 1] != st.pp_rank)
        add("pp", "send", boundary, m * sends, "forward", "pipeline activations")
        add("pp", "recv", boundary, m * recvs, "forward", "pipeline activations")
        add("pp", "send", boundary, m * recvs, "backward", "pipeline gradients")
        add("pp", "recv", boundary, m * sends, "backward", "pipeline gradients")
        add("pp", "all_reduce", 4, 1, "step", "loss to every stage")
        add("pp", "all_reduce", 8, 1, "step", "gradient norm")
        if args.n_experts:
            add("pp", "all_reduce", 4, 1, "step", "MoE load")
    # per step: valid tokens (int64) and the loss (fp32) over dp x cp
    add("dp_cp", "all_reduce", 8, 1, "step", "valid-token count", size_one=True)
    add("dp_cp", "all_reduce", 4, 1, "step", "loss", size_one=True)
    for group, calls in _norm_groups(layout, st, args.n_experts > 0).items():
        add(group, "all_reduce", 8, calls, "step", "gradient norm", size_one=True)
    if n_moe:
        add("dp_cp_tp", "all_reduce", 4 * n_moe * args.n_experts, 1, "step", "MoE token counts",
            size_one=True)
    return out


def _norm_groups(layout: Layout, st: RankStates, moe: bool) -> dict[str, int]:
    """All-reduces of the gradient norm's partial sums: one per (parameter mesh, sharded dims)
    group per sharded dim (shardwise/optim/clip.py)."""
    calls: dict[str, int] = {}

    def count(*groups: str) -> None:
        for g in groups:
            calls[g] = calls.get(g, 0) + 1

    block_kinds = {u.group for u in st.units}
    fsdp = "dp_shard_cp"
    if layout.tp > 1:
        count(fsdp, "tp")  # tensor-parallel weights: sharded on FSDP's dim and tp
    count(fsdp)  # norms (and everything without TP)
    if moe and "moe" in block_kinds:
        count("moe")
    if "efsdp" in block_kinds:
        count("efsdp", "ep")
    return calls


def totals(colls: list[Collective]) -> dict[str, dict[str, int]]:
    """Bytes per (mesh dim, collective) over the step, like comm.json's totals."""
    out: dict[str, dict[str, int]] = {}
    for c in colls:
        per = out.setdefault(c.group, {})
        per[c.kind] = per.get(c.kind, 0) + c.total
    return out
