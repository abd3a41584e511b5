"""The token loss of one micro-batch, the same function for training and evaluation: plain logits
then cross-entropy (optionally compiled), vocab-sharded DTensor logits under loss parallel, or the
fused chunked projection + cross-entropy (no logits at all)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardwise.data.dataset import IGNORE_INDEX, Batch
from shardwise.parallel.tensor import full_value


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (fp32), ``IGNORE_INDEX`` labels excluded."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def loss_context(logits: torch.Tensor) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` for vocab-sharded DTensor logits (TP), else nothing."""
    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


class TokenLoss:
    """Summed token loss of a micro-batch. ``chunk`` > 0: the model's fused chunked projection +
    loss over that many tokens at a time (training.loss_chunk); ``compiled``: the fused loss's
    softmax-gradient pass, or the plain loss (fp32 upcast, log-softmax, gather), through
    torch.compile -- loss-parallel DTensor logits stay eager."""

    def __init__(self, chunk: int = 0, compiled: bool = False) -> None:
        self.chunk, self.compiled = chunk, compiled
        self.plain = torch.compile(token_loss_sum) if compiled else token_loss_sum

    def __call__(self, model: nn.Module, batch: Batch, backward_over: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The summed loss (detached, the full value on every TP rank). With ``backward_over`` (the
        global valid-token count), also the backward of ``loss / backward_over``."""
        if self.chunk:
            loss = model(batch.inputs, batch.doc_ids, labels=batch.labels, ignore_index=IGNORE_INDEX,
                         loss_chunk=self.chunk, loss_compiled=self.compiled)
            if backward_over is not None:
                (loss / backward_over).backward()
            return loss.detach()
        logits = model(batch.inputs, batch.doc_ids)  # (B, S, V); vocab-sharded DTensor under loss parallel
        with loss_context(logits):  # the backward of a loss-parallel cross-entropy needs it too
            loss = (token_loss_sum if isinstance(logits, DTensor) else self.plain)(logits, batch.labels)
            del logits  # the loss saved what its backward needs (fp32); these are not needed
            if backward_over is not None:
                (loss / backward_over).backward()
        return full_value(loss.detach())
