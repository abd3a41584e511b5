"""What a model family declares for the parallelisms: all that ``parallel/`` may know of a model.

``parallel/*.py`` apply these plans and import no model class (tests/unit/test_structure.py holds
it), so a new family adds its modules and plans under ``models/`` and nothing to ``parallel/``.
A model built by :func:`shardwise.models.transformer.build_model` has:

- ``model.layers``: an ``nn.ModuleDict`` of blocks keyed by layer index (pipeline stages take
  contiguous runs of it: the model's split points are between blocks), ``model.args`` and a
  ``model.rope`` table;
- ``model.plan``: a :class:`ModelPlan`, the model's ends;
- ``block.plan`` on each block: a :class:`BlockPlan`;
- ``model.placeholder_forward()``: a context for forwards on placeholder inputs (the pipeline's
  shape inference): they count in no statistic (the experts' token loads) and ``model.placeholder``
  is true meanwhile (captures skip them).
- a linear that splits its own way under tensor parallel names the styles on its class:
  ``colwise_style`` / ``rowwise_style`` (torch ``ParallelStyle`` classes taking the column- or
  row-parallel style's arguments), used instead of torch's: LoRA's adapted linears
  (models/lora.py) split their adapters with their weight.

Names are submodule paths relative to the block (or the model, for the ends). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelPlan:
    """The model's ends: the first pipeline stage keeps the embedding, the last the final norm and
    the output head. Under tensor parallel the embedding is a vocab-sharded lookup whose partial
    sums are reduce-scattered into sequence shards, the norm runs on the sequence shard and the head
    is column-parallel (vocab-sharded logits)."""

    embedding: str = "tok_embeddings"
    norm: str = "norm"
    head: str = "output"
    """None on the model when the embedding is tied (the head reuses the embedding's weight)."""


@dataclass(frozen=True)
class LinearGroup:
    """Linear layers that run between one sequence all-gather and one reduce-scatter under tensor
    parallel (Megatron's column- then row-parallel pair), and that float8 converts together."""

    region: str
    """The submodule they are in; its input is gathered over tp when ``split``."""
    columns: tuple[str, ...]
    """Column-parallel: each tp rank computes a slice of their outputs (whole heads, a slice of the
    hidden width)."""
    rows: tuple[str, ...]
    """Row-parallel: each rank takes its slice of the input; the partial sums are reduce-scattered
    back into sequence shards."""
    inputs: int = 1
    """The region's positional inputs; the first is the hidden states, the rest are passed as they
    are (the same on every rank: a RoPE table, a mask)."""
    replicated: tuple[str, ...] = ()
    """Submodules of the region whose weights are whole on every tp rank and that run on the
    gathered input (MLA's low-rank compressions and their norms): their outputs are replicated and
    their weight gradients are summed over tp."""
    shared: tuple[str, ...] = ()
    """Submodules whose replicated input is read by this rank's heads only (MLA's shared RoPE key):
    past them the tensor is local, and its gradient a partial sum over tp."""
    split: bool = True
    """Split over tp. False: the group runs on the sequence shard inside a region that is not
    split (an MoE block's shared expert); float8 still converts it, at full width."""


@dataclass(frozen=True)
class BlockPlan:
    """How one block is parallelized, by submodule name."""

    groups: tuple[LinearGroup, ...]
    sequence_norms: tuple[str, ...] = ()
    """Norms on the sequence shard (sequence parallel): their weight gradients are summed over tp."""
    head_norms: tuple[str, ...] = ()
    """Norms applied per attention head (dim 2 of (B, S, H, D)), on this rank's heads under tp."""
    local: tuple[str, ...] = ()
    """Regions that stay on the sequence shard under tp (each rank processes its own S/tp tokens,
    their weights are not split over tp): an MoE feed-forward."""
    routed: str = ""
    """The routed feed-forward, if any: FSDP shards it over every rank that routes different tokens
    (dp_shard x cp x tp), as a unit of its own."""
    experts: str = ""
    """Its grouped experts: every parameter's dim 0 is the expert; ``forward(x, counts)`` takes the
    rows sorted by expert and the rows per expert. Expert parallel splits dim 0 over ep."""
    attention_core: str = ""
    """The module that computes attention from (B, H, S, D) q, k, v: context parallel makes it a
    ring attention."""
    high_precision: dict[str, str] = field(default_factory=dict)
    """Linear-like submodules float8 leaves alone, and why."""


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, in order (a pipeline stage's own ones)."""
    return list(model.layers.values())  # type: ignore[union-attr]


def has_experts(model: nn.Module) -> bool:
    return any(b.plan.experts for b in blocks(model))
