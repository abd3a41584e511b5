"""Seconds of a step's collectives: each call by the ring (alpha-beta) model, and what of FSDP's
traffic hides behind compute.

Each collective of :func:`shardwise.plan.comm.step_collectives` costs ``latency * hops + bytes *
factor / bandwidth`` (ring algorithms: ``(n-1)/n`` of the buffer for all-gather, reduce-scatter and
all-to-all, twice that for all-reduce), with intra- or inter-node bandwidth by whether the group's
ranks fit in one node; a ring through several nodes pays the network latency once per node and the
intra-node latency for its other hops. On local (gloo) ranks each call also waits for the job's
slowest process. With ``comm_overlap`` (GPUs) FSDP's collectives follow FSDP2's schedule
(:func:`fsdp_exposed_seconds`); tensor, context, expert and pipeline traffic is on the critical
path. On the CPU (gloo) nothing overlaps.
"""

from __future__ import annotations

import functools

from shardwise.parallel.dims import Degrees
from shardwise.plan.activations import Shape
from shardwise.plan.comm import Collective, group_members, unit_collectives
from shardwise.plan.hardware import Hardware
from shardwise.plan.states import RankStates
from shardwise.resolve.run import ResolvedRun


def per_mesh_dim(colls: list[Collective], seconds: list[float]) -> dict[str, float]:
    """Seconds of the collectives summed per mesh dim."""
    comm: dict[str, float] = {}
    for c, secs in zip(colls, seconds, strict=True):
        comm[c.group] = comm.get(c.group, 0.0) + secs
    return comm


def fsdp_exposed_seconds(run: ResolvedRun, rank_states: RankStates, hw: Hardware, shape: Shape,
                         forward: dict[int, float], backward: dict[int, float], head: float) -> float:
    """Seconds of FSDP's collectives left on the critical path of a step without pipeline
    parallel, as FSDP2 schedules them on GPU streams. ``forward``, ``backward``: each block's
    seconds for one micro-batch (:func:`~shardwise.plan.cost.rank_time` gives a block's forward
    1 / (3 + r) of the two, backward GEMMs doing twice the forward's work, r = 1 when it is
    recomputed); ``head``: the output head's and loss's forward and backward.

    Per micro-batch, with one channel for all of the rank's FSDP traffic, served in the order it
    is issued:

    - forward: the root's gather and the first block's wait for nothing (the embedding is all the
      compute before them); block i's gather is issued when block i-1 starts computing (implicit
      prefetch, one unit ahead -- the next copy-out frees the previous gather) and shows by what it
      exceeds block i-1's forward;
    - backward: the output head's backward hides the last block's gather (if it was resharded);
      while block i runs its backward the channel carries block i+1's reduction (issued as its
      backward ended) and then block i-1's gather (prefetched as block i's backward starts), and
      shows by what the two exceed that backward;
    - the first block's and the root's reductions end the micro-batch with nothing to hide behind
      (the next micro-batch's forward needs its own gathers first).

    The head's forward is a third of its time. A reduction is the reduce-scatter plus, under HSDP,
    the all-reduce over replicas."""
    gather: dict[int | None, float] = {}
    reduce: dict[int | None, float] = {}
    resharded: dict[int | None, bool] = {}
    per_unit: dict[tuple, tuple[float, float]] = {}  # (one gather, one reduction) by unit shape
    for unit in rank_states.units:
        key = (unit.numel, unit.shard, unit.group, unit.replicate, unit.reshard)
        if key not in per_unit:
            times = [0.0, 0.0]
            for c in unit_collectives(run, unit, shape):
                if c.phase == "forward" or c.kind != "all_gather":  # (a backward gather repeats)
                    times[c.kind != "all_gather"] += collective_time(c, run.dims.degrees, hw) / c.calls
            per_unit[key] = (times[0], times[1])
        gather[unit.layer] = gather.get(unit.layer, 0.0) + per_unit[key][0]
        reduce[unit.layer] = reduce.get(unit.layer, 0.0) + per_unit[key][1]
        resharded[unit.layer] = resharded.get(unit.layer, False) or unit.reshard
    layers = list(rank_states.layers)
    a = [gather.get(i, 0.0) for i in layers]
    r = [reduce.get(i, 0.0) for i in layers]
    again = [a[j] if resharded.get(i) else 0.0 for j, i in enumerate(layers)]  # gathered for backward
    f, b = [forward[i] for i in layers], [backward[i] for i in layers]
    exposed = gather.get(None, 0.0) + reduce.get(None, 0.0)
    if layers:
        exposed += a[0] + sum(max(0.0, a[j] - f[j - 1]) for j in range(1, len(layers)))
        exposed += max(0.0, again[-1] - 2 * head / 3)
        after = r[1:] + [0.0]  # the reduction of the block whose backward ran before
        exposed += sum(max(0.0, after[j] + (again[j - 1] if j else 0.0) - b[j]) for j in range(len(layers)))
        exposed += r[0]
    return exposed * run.micro_batches


def fsdp_hidden_seconds(colls: list[Collective], seconds: list[float], hw: Hardware, compute: float) -> float:
    """Seconds of FSDP's collectives hidden behind ``compute`` seconds on a pipeline rank (0
    without ``comm_overlap``), which gathers its units once per step and reduces them once: exposed
    are the step's first gather and last reduction, or whatever of the traffic the compute is too
    short to cover."""
    fsdp = [(c, secs) for c, secs in zip(colls, seconds, strict=True) if c.overlap == "fsdp"]
    fsdp_total = sum(secs for _, secs in fsdp)
    if not (hw.comm_overlap and fsdp_total):
        return 0.0
    edges = (max((secs / c.calls for c, secs in fsdp if c.kind == "all_gather"), default=0.0)
             + max((secs / c.calls for c, secs in fsdp if c.kind != "all_gather"), default=0.0))
    return fsdp_total - max(min(edges, fsdp_total), fsdp_total - compute)


def collective_time(c: Collective, degrees: Degrees, hw: Hardware, pp_rank: int = 0) -> float:
    """Seconds of all calls of ``c`` (ring algorithms, alpha-beta)."""
    members = group_members(degrees, c.group, pp_rank)
    n = len(members)
    if n <= 1:
        return 0.0
    span = max(members) - min(members) + 1
    if c.kind in ("send", "recv"):
        span = degrees.world // degrees.pp + 1  # neighbouring stages are a stage's width apart
    bw, lat = hw.link(span, n, degrees.world, c.kind, c.nbytes)
    if c.kind == "all_reduce":
        factor, passes = 2 * (n - 1) / n, 2
    elif c.kind in ("send", "recv"):
        factor, passes = 1.0, 0
    else:
        factor, passes = (n - 1) / n, 1
    if not passes:
        hops = lat
    elif hw.cores or span <= hw.gpus_per_node:
        hops = passes * (n - 1) * lat
    else:  # a ring through several nodes: one hop into each node, the rest inside one
        nodes = _nodes(members, hw.gpus_per_node)
        intra = hw.link(1)[1]
        hops = passes * (nodes * lat + (n - nodes) * intra)
    # (local: each call also waits for the job's slowest process to reach it)
    return c.calls * (hops + factor * c.nbytes / bw + hw.sync_seconds(degrees.world))


@functools.lru_cache(maxsize=65536)
def _nodes(members: frozenset[int], per_node: int) -> int:
    """Nodes a group's ranks sit on (ranks fill nodes in order)."""
    return len({r // per_node for r in members})
