"""Pipeline parallel on ``torch.distributed.pipelining``: the model split by layers into stages.

Rank ``r`` of the ``pp`` mesh dim holds stage ``r``: stage 0 keeps the embedding, the last stage
the final norm and output head, and the blocks are split as evenly as possible (earlier stages
take the remainder). Parameter names stay those of the full model, so initialization (seeded by
name), checkpoints (DCP, by name) and resharding between PP and non-PP layouts need nothing special.

Schedules: GPipe (Huang et al., 2019) runs every micro-batch's forward, then every backward;
1F1B (PipeDream-Flush, Narayanan et al., 2021) alternates them after a warm-up, holding at most
``pp`` micro-batches of activations. The micro-batches are the gradient-accumulation micro-batches
of the step. Gradient scaling is off (``scale_grads=False``): the loss function already divides
each micro-batch's summed token loss by the global valid-token count.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shardwise.models.moe import routing_not_counted
from shardwise.parallel.tensor import full_value

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Stage(PipelineStage):
    """A PipelineStage whose shape inference does not count as MoE routing.

    Before the first step torch runs the stage once on placeholder tensors to learn the shapes it
    exchanges (``_shape_inference`` in torch 2.11, ``_forward_metadata_inference`` in 2.13); an MoE
    block would otherwise count those tokens into its expert loads."""


def _uncounted(name: str) -> None:
    original = getattr(PipelineStage, name)

    def wrapper(self: Stage, *args: object, **kwargs: object) -> object:
        with routing_not_counted(self.submod):
            return original(self, *args, **kwargs)
    setattr(Stage, name, wrapper)


for _name in ("_shape_inference", "_forward_metadata_inference"):
    if hasattr(PipelineStage, _name):
        _uncounted(_name)


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous block indices per stage, as even as possible, earlier stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def split_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of the (meta-device) model keeping only what ``stage`` runs."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in stage_layers(len(model.layers), n_stages)[stage]}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


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

    def __init__(self, stage_module: nn.Module, mesh: DeviceMesh, device: torch.device, schedule: str,
                 n_microbatches: int, token_loss_sum: Callable, loss_context: Callable) -> None:
        self.mesh, self.device, self.loss_context = mesh, device, loss_context
        self.loss = PipelineLoss(token_loss_sum)
        rank, size = mesh.get_local_rank(), mesh.size()
        self.stage = Stage(stage_module, rank, size, device, group=mesh.get_group())
        self.schedule = SCHEDULES[schedule](self.stage, n_microbatches, loss_fn=self.loss,
                                            scale_grads=False)
        self.is_first, self.is_last = rank == 0, rank == size - 1

    def _run(self, fn: Callable, batches: list, n_valid: torch.Tensor | float) -> torch.Tensor:
        self.loss.n_valid = n_valid
        inputs = torch.cat([b.inputs for b in batches])  # (micro-batches * B, S); the schedule splits it
        labels = torch.cat([b.labels for b in batches])
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        with self.loss_context():
            fn(*args, target=labels if self.is_last else None, losses=losses if self.is_last else None)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses:  # last stage only: the micro-batches' scaled losses
            total += full_value(loss).detach()
        total *= n_valid
        torch.distributed.all_reduce(total, group=self.mesh.get_group())  # last stage's sum to all stages
        return total

    def forward_backward(self, batches: list, n_valid: torch.Tensor) -> torch.Tensor:
        """Forward + backward of all micro-batches; the summed token loss (every stage gets it)."""
        return self._run(self.schedule.step, batches, n_valid)

    @torch.no_grad()
    def loss_sum(self, batches: list) -> torch.Tensor:
        """Summed token loss of the micro-batches, forward only."""
        return self._run(self.schedule.eval, batches, 1.0)
