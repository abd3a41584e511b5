"""Pipeline parallel on ``torch.distributed.pipelining``: the model split by layers into stages.

The model is cut into ``pp * v`` stages (``v`` stages per rank): stage 0 keeps the embedding, the
last stage the final norm and output head, and the blocks are split as evenly as possible (earlier
stages take the remainder). Which rank holds which stages depends on the schedule:

- ``gpipe``, ``1f1b`` -- one stage per rank (``v = 1``); GPipe (Huang et al., 2019) runs every
  micro-batch's forward, then every backward; 1F1B (PipeDream-Flush, Narayanan et al., 2021)
  alternates them after a warm-up, holding at most ``pp`` micro-batches of activations.
- ``interleaved1f1b`` -- ``v = parallel.pp_stages_per_rank`` stages per rank in a loop (rank r holds
  stages r, r+pp, ...): the bubble shrinks by ``v`` for ``v`` times the point-to-point traffic
  (Narayanan et al., 2021).
- ``zbv`` (zero-bubble V, Qi et al., 2024) and ``dualpipev`` (DeepSeek-V3's DualPipe in its V form)
  -- two stages per rank in a V (rank r holds stages r and 2*pp-1-r, so rank 0 holds both the
  embedding and the head); backward is split into input- and weight-gradient passes that fill the
  bubble.

Each rank builds one module -- the union of its stages (parameter names those of the full model,
so initialization seeded by name, DCP checkpoints and resharding between layouts need nothing
special) -- and with several stages per rank each stage is a :class:`StageView` sharing that
module's blocks, made by :func:`attach_stage_views` before parallelization. Each stage module is
an FSDP root (torch's schedules drive FSDP's gradient reduction through the stage module; the
zero-bubble weight-gradient pass needs it). The micro-batches
are the step's gradient-accumulation micro-batches. Gradient scaling is off (``scale_grads=False``):
the loss function already divides each micro-batch's summed token loss by the global valid-token
count.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.parallel.stages import V_SHAPED, rank_stages, stage_layers
from shardwise.parallel.tensor import full_value

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
             "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""Schedule name -> its class in torch.distributed.pipelining (imported on a pipeline's first use:
it imports torch._dynamo, a second of start-up for the launcher and the planner, which need only
this module's stage arithmetic)."""


@functools.cache
def _stage_class() -> type:
    """torch's PipelineStage, made to run its shape inference as a placeholder forward (the model
    counts it in no statistic -- MoE routing loads -- and no capture): before the
    first step torch runs the stage once on placeholder tensors to learn the shapes it exchanges
    (``_shape_inference`` in torch 2.11, ``_forward_metadata_inference`` in 2.13); an MoE block
    would otherwise count those tokens into its expert loads."""
    from torch.distributed.pipelining import PipelineStage

    def uncounted(name: str) -> Callable:
        original = getattr(PipelineStage, name)

        def wrapper(self: PipelineStage, *args: object, **kwargs: object) -> object:
            with self.submod.placeholder_forward():
                return original(self, *args, **kwargs)
        return wrapper
    names = [n for n in ("_shape_inference", "_forward_metadata_inference") if hasattr(PipelineStage, n)]
    return type("Stage", (PipelineStage,), {n: uncounted(n) for n in names})


def split_stage(model: nn.Module, stages: int | list[int], n_stages: int) -> nn.Module:
    """A copy of the (meta-device) model keeping only what ``stages`` run: their blocks, the
    embedding if stage 0 is among them, the final norm and head if the last stage is."""
    stages = [stages] if isinstance(stages, int) else stages
    per_stage = stage_layers(len(model.layers), n_stages)
    keep = {str(i) for s in stages for i in per_stage[s]}
    # Copy only the kept blocks: deep-copying all 126 blocks of a 405B model on meta for each rank
    # took longer than building it.
    every = model.layers
    model.layers = nn.ModuleDict({k: b for k, b in every.items() if k in keep})
    # Process groups a module holds (an MoE block's sequence group under cp or tp) are shared by
    # the copy: they cannot be copied, and the stage runs on the same ranks.
    groups = {id(v): v for m in model.modules() for v in vars(m).values()
              if isinstance(v, torch.distributed.ProcessGroup)}
    try:
        part = copy.deepcopy(model, memo=groups)
    finally:
        model.layers = every
    ends = model.plan
    if 0 not in stages:
        setattr(part, ends.embedding, None)
    if n_stages - 1 not in stages:
        setattr(part, ends.norm, None)
        setattr(part, ends.head, None)
    return part


def attach_stage_views(part: nn.Module, stages: list[int], n_stages: int) -> None:
    """With several stages on this rank, give the part one :class:`StageView` per stage
    (``part.stage_views``, a plain list: the views are not submodules of the part)."""
    part.stage_views = [StageView(part, s, n_stages) for s in stages] if len(stages) > 1 else []


class StageView(nn.Module):
    """One stage of a rank's part: its blocks (and embedding / head) are the part's own modules,
    so parameters, FSDP units and checkpoints stay with the part."""

    def __init__(self, part: nn.Module, stage: int, n_stages: int) -> None:
        super().__init__()
        self._part = [part]  # a list, so the part is not registered as a child
        self.args, self.plan = part.args, part.plan
        layer_ids = stage_layers(part.args.n_layers, n_stages)[stage]
        ends = part.plan
        setattr(self, ends.embedding, getattr(part, ends.embedding) if stage == 0 else None)
        self.layers = nn.ModuleDict({str(i): part.layers[str(i)] for i in layer_ids})
        last = stage == n_stages - 1
        setattr(self, ends.norm, getattr(part, ends.norm) if last else None)
        setattr(self, ends.head, getattr(part, ends.head) if last else None)

    @property
    def rope(self) -> torch.Tensor:  # the part's RoPE table (init_weights replaces it)
        return self._part[0].rope

    @property
    def document_spans(self) -> Callable:  # (context parallel replaces the part's)
        return self._part[0].document_spans

    def placeholder_forward(self) -> contextlib.AbstractContextManager:
        return self._part[0].placeholder_forward()

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return type(self._part[0]).forward(self, tokens, doc_ids)


class PipelineLoss:
    """The schedule's loss function: summed token loss over the global valid-token count, which
    ``n_valid`` is set to before each step. (It keeps no tally: the schedule also calls it on
    uninitialized buffers when it infers shapes, so the per-micro-batch losses the schedule returns
    are what gets summed.)"""

    def __init__(self, token_loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.token_loss_sum = token_loss_sum
        self.n_valid: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.token_loss_sum(logits, labels) / self.n_valid


class Pipe:
    """This rank's PipelineStage (over the ``pp`` mesh dim) and its schedule; runs a step's
    micro-batches through them."""

    def __init__(self, part: nn.Module, mesh: DeviceMesh, device: torch.device, schedule: str,
                 n_microbatches: int, token_loss_sum: Callable, loss_context: Callable,
                 interleaved: int = 2) -> None:
        self.mesh, self.device, self.loss_context = mesh, device, loss_context
        self.loss = PipelineLoss(token_loss_sum)
        rank, size = mesh.get_local_rank(), mesh.size()
        ids = rank_stages(rank, size, schedule, interleaved)
        n_stages = size * len(ids)
        group = mesh.get_group()
        import torch.distributed.pipelining as pipelining

        stage, schedule_class = _stage_class(), getattr(pipelining, SCHEDULES[schedule])
        if len(ids) == 1:
            self.stages = [stage(part, ids[0], n_stages, device, group=group)]
            self.schedule = schedule_class(self.stages[0], n_microbatches, loss_fn=self.loss,
                                           scale_grads=False)
        else:
            self.stages = [stage(view, i, n_stages, device, group=group)
                           for view, i in zip(part.stage_views, ids, strict=True)]
            self.schedule = schedule_class(self.stages, n_microbatches, loss_fn=self.loss,
                                           scale_grads=False)
        self.is_first, self.is_last = 0 in ids, n_stages - 1 in ids
        self.v_shaped = schedule in V_SHAPED
        self._eval_order: dict | None = None  # (V_SHAPED: the forward-only order, built on first eval)
        # By default the last stage keeps every micro-batch's output (the logits) to return them
        # merged; the losses are all the trainer reads, so it asks for none of that memory.
        takes = inspect.signature(self.schedule.step).parameters
        self.step_kwargs = {"return_outputs": False} if "return_outputs" in takes else {}

    def _run(self, fn: Callable, batches: list, n_valid: torch.Tensor | float) -> torch.Tensor:
        self.loss.n_valid = n_valid
        inputs = torch.cat([b.inputs for b in batches])  # (micro-batches * B, S); the schedule splits it
        labels = torch.cat([b.labels for b in batches])
        args = (inputs,) if self.is_first else ()
        # Document ids go to every stage as a keyword input (torch splits keyword inputs by micro-batch
        # and hands them to each stage's forward, first or not): each stage masks its own attention.
        docs = {"doc_ids": torch.cat([b.doc_ids for b in batches])} if batches[0].doc_ids is not None else {}
        losses: list[torch.Tensor] = []
        with self.loss_context():
            fn(*args, target=labels if self.is_last else None, losses=losses if self.is_last else None,
               **docs)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses:  # last stage only: the micro-batches' scaled losses
            total += full_value(loss).detach()
        total *= n_valid
        torch.distributed.all_reduce(total, group=self.mesh.get_group())  # last stage's sum to all stages
        return total

    def forward_backward(self, batches: list, n_valid: torch.Tensor) -> torch.Tensor:
        """Forward + backward of all micro-batches; the summed token loss (every stage gets it)."""
        return self._run(functools.partial(self.schedule.step, **self.step_kwargs), batches, n_valid)

    @torch.no_grad()
    def loss_sum(self, batches: list) -> torch.Tensor:
        """Summed token loss of the micro-batches, forward only."""
        with self._forward_only_order():
            return self._run(self.schedule.eval, batches, 1.0)

    @contextlib.contextmanager
    def _forward_only_order(self) -> Iterator[None]:
        """torch's ``eval()`` of a V-shaped schedule (ZB-V, DualPipeV) still walks its backward
        actions, and where two stages sit on one rank it hands the later stage's (never computed)
        input gradient to the earlier one, which raises (torch 2.13: "can't steal_bwd_input if this
        stage doesn't have backward"). Evaluation runs the schedule's forward actions alone, in
        their order, lowered with their sends and receives by torch's own passes; the training
        order is put back afterwards."""
        sched = self.schedule
        if not self.v_shaped:
            yield
            return
        from torch.distributed.pipelining.schedules import (
            _add_send_recv,
            _add_unshard_reshard,
            _ComputationType,
        )

        train = sched.pipeline_order_with_comms
        if self._eval_order is None:
            forward = {rank: _add_unshard_reshard([x for a in actions if a is not None
                                                   for x in (a.sub_actions or (a,))
                                                   if x.computation_type == _ComputationType.FORWARD])
                       for rank, actions in sched.pipeline_order.items()}
            # (the lowering _prepare_schedule_with_comms runs, without its check that every stage
            # has its backward)
            self._eval_order = _add_send_recv(forward, lambda s: sched.stage_index_to_group_rank[s],
                                              sched._num_stages)
        sched.pipeline_order_with_comms = self._eval_order
        try:
            yield
        finally:
            sched.pipeline_order_with_comms = train
