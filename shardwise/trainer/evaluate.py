"""The validation loss: every ``eval.interval`` steps and at the last, the mean token loss over the
first ``eval.steps`` global batches of the held-out split, with the training loss function
(:class:`Evaluator`); :func:`score` is shared with ``shardwise eval`` (shardwise/eval_command.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config.notice import say
from shardwise.data.dataset import Batch, Corpus, PackedLoader, Stream
from shardwise.parallel.dims import Mesh
from shardwise.parallel.pipeline import Pipe
from shardwise.resolve.run import ResolvedRun
from shardwise.trainer.loss import TokenLoss


class Evaluator:
    """Decides when to evaluate and does it (each source's held-out documents, mixed by the
    training weights)."""

    def __init__(self, run: ResolvedRun, corpus: Corpus, loss: TokenLoss, device: torch.device,
                 pipe: Pipe | None, shard: Callable[[list[Batch]], list[Batch]]) -> None:
        self.run, self.loss, self.device, self.pipe, self.shard = run, loss, device, pipe, shard
        t = run.cfg.training
        self.val = [(s, w) for s, w in zip(corpus.val, corpus.val_weights, strict=True)
                    if s.num_windows(t.seq_len)]
        windows = sum(s.num_windows(t.seq_len) for s, _ in self.val)
        self.batches = min(run.cfg.eval.steps, windows // t.global_batch)
        if run.cfg.eval.interval and not self.batches and dist.get_rank() == 0:
            say(f"warning: the validation split has {windows} sequences of {t.seq_len} tokens, fewer "
                f"than one global batch ({t.global_batch}): no validation loss (raise "
                "data.val_fraction)")

    def due(self, step: int, last: bool) -> bool:
        interval = self.run.cfg.eval.interval
        return interval > 0 and (step % interval == 0 or last)

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        """``{"val_loss": ...}`` (empty when the held-out split has no full global batch)."""
        if self.batches == 0:
            return {}
        sums = score(model, self.run, [s for s, _ in self.val], [w for _, w in self.val], self.batches,
                     self.loss, self.device, self.pipe, self.shard)
        return {"val_loss": (sums[0] / sums[1].clamp(min=1)).item()}  # .item() syncs


def score(model: nn.Module, run: ResolvedRun, streams: list[Stream], weights: list[float], batches: int,
          loss: TokenLoss, device: torch.device, pipe: Pipe | None,
          shard: Callable[[list[Batch]], list[Batch]]) -> torch.Tensor:
    """(summed token loss, valid tokens) over the first ``batches`` global batches of ``streams``
    (in order, mixed by ``weights``), summed over every rank: a float64 (2,) tensor."""
    t, dims = run.cfg.training, run.dims
    loader = PackedLoader(streams, t.seq_len, t.global_batch, run.micro_batch,
                          dims.submesh(Mesh.DP).get_local_rank(), dims.dp, seed=0,
                          document_mask=run.cfg.data.document_mask, device=device, shuffle=False,
                          weights=weights)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, valid tokens)
    with torch.no_grad():
        for _ in range(batches):
            mbs = shard(loader.next_step())
            sums[1] += sum(b.n_valid for b in mbs)
            if pipe is not None:
                sums[0] += pipe.loss_sum(mbs)
                continue
            for b in mbs:
                sums[0] += loss(model, b)
    dist.all_reduce(sums, group=dims.submesh(Mesh.DP_CP).get_group())  # over dp x cp
    return sums
