"""``Layout``: one way to run a training job -- parallel degrees, pipeline schedule, micro-batch and
activation checkpointing -- as a frozen, hashable value with a readable ``str``.

The planner's candidates are layouts (enumerate -> filter -> cost -> choose, the shape of torch's
DTensor redistribute planner). A layout turns into a full training config with :meth:`Layout.apply`,
so what is estimated is exactly what ``shardwise train`` would run.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from shardwise.config.schema import Config
from shardwise.parallel.dims import DEGREES, MESH_DIMS, ParallelDims
from shardwise.parallel.pipeline import stages_per_rank
from shardwise.resolve.run import micro_batch_size


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 2
    micro_batch: int = 1
    """Sequences per rank per forward/backward (the pipeline's micro-batch under PP)."""
    ac: str = "none"
    ac_every: int = 2

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds (1 without PP)."""
        return stages_per_rank(self.pp_schedule, self.pp_stages_per_rank) if self.pp > 1 else 1

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per rank per optimizer step (accumulation steps, or the pipeline's)."""
        return global_batch // self.dp // self.micro_batch

    def __str__(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1] or ["1 rank"]
        text = " ".join(parts)
        if self.pp > 1:
            sched = self.pp_schedule + (f"(v{self.pp_stages_per_rank})"
                                        if self.pp_schedule == "interleaved1f1b" else "")
            text += f" {sched}"
        ac = self.ac if self.ac != "layer" else f"layer/{self.ac_every}"
        return f"{text} mb{self.micro_batch} ac={ac}"

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> Layout:
        """The layout ``cfg`` runs on ``world`` ranks (``dp_shard=-1`` resolved)."""
        dims = ParallelDims.from_config(cfg.parallel, world)
        pc, t = cfg.parallel, cfg.training
        return cls(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp,
                   tp=dims.tp, ep=dims.ep, pp_schedule=pc.pp_schedule,
                   pp_stages_per_rank=pc.pp_stages_per_rank,
                   micro_batch=micro_batch_size(t, dims.dp), ac=cfg.activation_checkpoint.mode,
                   ac_every=cfg.activation_checkpoint.every)

    def apply(self, base: Config) -> Config:
        """A copy of ``base`` that runs this layout (the sections it changes are copied; the others
        are shared with ``base``)."""
        cfg = copy.copy(base)
        cfg.parallel = dataclasses.replace(base.parallel, **{k: getattr(self, k) for k in DEGREES},
                                           pp_schedule=self.pp_schedule,
                                           pp_stages_per_rank=self.pp_stages_per_rank)
        cfg.training = dataclasses.replace(base.training, micro_batch=self.micro_batch)
        cfg.activation_checkpoint = dataclasses.replace(base.activation_checkpoint, mode=self.ac,
                                                        every=self.ac_every)
        return cfg


def mesh_dim_span(layout: Layout, dims: tuple[str, ...]) -> tuple[int, int]:
    """(size, stride) in ranks of a (possibly flattened) mesh dim made of ``dims``: ranks are laid out
    pp, dp_replicate, dp_shard, cp, tp from outermost to innermost, so a group's members are
    ``stride`` ranks apart and together span ``size * stride`` consecutive ranks."""
    inner = MESH_DIMS.index(max(dims, key=MESH_DIMS.index))
    stride = math.prod(getattr(layout, d) for d in MESH_DIMS[inner + 1:])
    return math.prod(getattr(layout, d) for d in dims), stride
