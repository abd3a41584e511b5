"""The order of a pipeline rank's passes in one step, per schedule, from the pipeline's shape alone
(no stages, no process group): what the memory timeline replays and what the tests pin down."""

from __future__ import annotations

import functools

from shardwise.parallel.stages import PipelineShape


def in_flight(pipe: PipelineShape, micro_batches: int, pp_rank: int) -> float:
    """Micro-batches of this rank's full activations held at once by the pipeline schedule.

    GPipe holds all of them; 1F1B ``pp - rank`` (Narayanan et al., 2021); interleaved 1F1B
    ``(v - 1) * pp + 2 * (pp - 1 - rank) + 1`` chunks of ``1/v`` each (torch's warm-up count); the
    V schedules (ZB-V, DualPipeV) about ``pp`` (Qi et al., 2024)."""
    m, p, r = micro_batches, pipe.pp, pp_rank
    if p == 1:
        return 1.0
    sched = pipe.schedule
    if sched == "gpipe":
        return float(m)
    if sched == "1f1b":
        return float(min(m, p - r))
    if sched == "interleaved1f1b":
        v = pipe.interleaved
        return min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) / v
    return float(min(m, p + (1 if sched == "dualpipev" else 0)))


# ---------------------------------------------------------------------------------------------
# The step timeline


def schedule_actions(pipe: PipelineShape, micro_batches: int, pp_rank: int) -> list[tuple[str, int]]:
    """This rank's passes in the step's order as (kind, stage): F forward, B full backward, or the
    zero-bubble split I (input gradients) + W (weight gradients).

    GPipe runs every forward then every backward; 1F1B ``pp - rank`` forwards, then one backward and
    one forward alternating (Narayanan et al., 2021). The multi-stage schedules (interleaved 1F1B,
    ZB-V, DualPipeV) take torch's own per-rank order (its schedule classes compute it from the
    sizes alone); if a torch version lays that out differently, an interleaved 1F1B order with the
    warm-up depth of :func:`in_flight` stands in."""
    # The order depends on the pipeline's shape only; plan asks for it once per candidate layout.
    return list(_schedule_actions(pipe, micro_batches, pp_rank))


@functools.lru_cache(maxsize=4096)
def _schedule_actions(pipe: PipelineShape, micro_batches: int, pp_rank: int) -> tuple[tuple[str, int], ...]:
    return tuple(_actions(pipe, micro_batches, pp_rank))


def _actions(pipe: PipelineShape, micro_batches: int, pp_rank: int) -> list[tuple[str, int]]:
    m, p = micro_batches, pipe.pp
    if pipe.schedule in ("gpipe", "1f1b"):
        warmup = m if pipe.schedule == "gpipe" else min(m, p - pp_rank)
        order = [("F", pp_rank)] * warmup
        for _ in range(m - warmup):
            order += [("B", pp_rank), ("F", pp_rank)]
        return order + [("B", pp_rank)] * warmup
    try:
        return _torch_order(pipe, m, pp_rank)
    except (AttributeError, TypeError, ValueError, ImportError):
        v = pipe.stages_per_rank
        stages = [pp_rank + i * p for i in range(v)]
        warmup = min(m * v, max(1, round(in_flight(pipe, m, pp_rank) * v)))
        fwd = [("F", stages[(i // p) % v]) for i in range(m * v)]
        bwd = [("B", stages[v - 1 - (i // p) % v]) for i in range(m * v)]
        order = fwd[:warmup]
        for i in range(m * v - warmup):
            order += [bwd[i], fwd[warmup + i]]
        return order + bwd[m * v - warmup:]


def _torch_order(pipe: PipelineShape, m: int, pp_rank: int) -> list[tuple[str, int]]:
    """torch's action list for this rank of a multi-stage schedule, without building stages."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    cls = {"interleaved1f1b": schedules.ScheduleInterleaved1F1B, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV}[pipe.schedule]
    p, v = pipe.pp, pipe.stages_per_rank
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched.rank, sched._n_microbatches = p, v, pp_rank, m
    sched.num_stages = sched._num_stages = p * v
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    style = "loop" if pipe.schedule == "interleaved1f1b" else "v"
    sched.stage_index_to_group_rank = generate_stage_to_rank_mapping(p, p * v, style)
    out = []
    for action in sched._calculate_single_rank_operations(pp_rank):
        if action is None:
            continue
        for a in action.sub_actions or (action,):
            kind = a.computation_type.value
            if kind in ("F", "B", "I", "W"):
                out.append((kind, a.stage_index))
    return out
