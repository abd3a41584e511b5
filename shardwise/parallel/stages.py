"""The pipeline's stage arithmetic, without torch: how many stages each rank holds under each
schedule, which ones, and which blocks each stage runs. The trainer's checks and the planner need
only this; the pipeline itself (parallel/pipeline.py) builds on it."""

from __future__ import annotations

from typing import NamedTuple

V_SHAPED = ("zbv", "dualpipev")


def stages_per_rank(schedule: str, interleaved: int) -> int:
    if schedule in V_SHAPED:
        return 2
    return interleaved if schedule == "interleaved1f1b" else 1


class PipelineShape(NamedTuple):
    """What a schedule's order of passes depends on (hashable: the planner caches orders by it)."""

    pp: int
    schedule: str = "1f1b"
    interleaved: int = 2
    """parallel.pp_stages_per_rank (read by the interleaved schedule only)."""

    @property
    def stages_per_rank(self) -> int:
        """Stages each pp rank holds (1 without PP)."""
        return stages_per_rank(self.schedule, self.interleaved) if self.pp > 1 else 1


def rank_stages(rank: int, pp: int, schedule: str, interleaved: int = 2) -> list[int]:
    """The stage indices ``rank`` holds: looped (rank, rank+pp, ...) or V-shaped (zbv, dualpipev:
    rank and 2*pp-1-rank)."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(stages_per_rank(schedule, interleaved))]


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous block indices per stage, as even as possible, earlier stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
