"""``torch.compile`` per transformer block.

Each block is compiled on its own (``module.compile()``, which keeps the module and its parameter
names): the blocks have identical structure, so Dynamo compiles one graph and reuses it for every
block, and the compile time does not grow with depth. Compiling after tensor parallel and activation
checkpointing traces the DTensor ops and the recompute region; FSDP comes after, and Dynamo leaves
its hooks outside the graphs (torchtitan's order: TP -> AC -> compile -> FSDP).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from shardwise.models.protocol import blocks


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """Compile every block of ``model.layers`` in place (no-op when not ``enabled``: the resolved
    compile.enabled, ``ResolvedRun.compile``)."""
    if not enabled:
        return
    # Dynamo inlines nn modules (parameters are graph inputs), so blocks of one structure share a
    # graph; the limit is raised so a model with several block kinds (dense and MoE, checkpointed
    # or not) never exhausts the recompiles and falls back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for block in blocks(model):
        block.compile()
    embed = getattr(model, model.plan.embedding, None)
    if embed is not None:
        embed.register_forward_hook(_resolve_async_output)


def _resolve_async_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Under sequence parallel the embedding (eager) returns its reduce-scatter still in flight, an
    ``AsyncCollectiveTensor``. torch 2.13's AOTAutograd unwraps such a graph input to its grad-less
    inner tensor, so the first compiled block returned no input gradient and the embedding silently
    stopped learning (found by the compile x TP parity test; pytorch/pytorch#191113). A copy through
    the wrapper waits for the collective and keeps the autograd edge; it is (B, S/tp, dim), once."""
    return out.clone() if isinstance(out, AsyncCollectiveTensor) else out
