"""``Layout``: one way to run a training job -- parallel degrees, pipeline schedule, micro-batch and
activation checkpointing -- as a frozen, hashable value with a readable ``str``.

The planner's candidates are layouts (enumerate -> filter -> cost -> choose, the shape of torch's
DTensor redistribute planner): a layout is only the search's knobs. It turns into a training config
(:meth:`Layout.apply`) and that into the :class:`~shardwise.resolve.run.ResolvedRun` the trainer would
run (:meth:`Layout.resolve`), which is what the planner's states, memory, communication and time
take: one description of a run for trainer and planner.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from shardwise.config.model_args import ModelArgs
from shardwise.config.schema import Config
from shardwise.parallel.dims import DEGREES, Degrees
from shardwise.resolve.run import ResolvedRun, resolve_run


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
    def degrees(self) -> Degrees:
        return Degrees(self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep)

    @property
    def world(self) -> int:
        return self.degrees.world

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
    def of(cls, run: ResolvedRun) -> Layout:
        """The layout ``run`` runs."""
        pc, ac = run.cfg.parallel, run.cfg.activation_checkpoint
        return cls(*run.dims.degrees, pp_schedule=pc.pp_schedule,
                   pp_stages_per_rank=pc.pp_stages_per_rank, micro_batch=run.micro_batch, ac=ac.mode,
                   ac_every=ac.every)

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

    def resolve(self, base: Config, model: ModelArgs | None = None) -> ResolvedRun:
        """The run of ``base`` with this layout, resolved as ``shardwise train`` resolves it (raises
        its ConfigError when the trainer would refuse it). ``model``: ``base``'s model, made once by a
        caller resolving many layouts (a layout never changes the model)."""
        return resolve_run(self.apply(base), self.world, detect_device=False, model=model)
