"""Routing traces: what makes ``shardwise verify`` decisive for MoE layouts.

Top-k routing is discontinuous: when a token's k-th and (k+1)-th expert scores are within rounding
of each other, a layout that sums in another order (a different batch split, a sequence shard, an
all-reduce) can pick the other expert. One such flip among thousands of routing slots moves the
parameters far more than summation order ever does, so a layout with a correct computation can miss
a tight tolerance -- and a tolerance wide enough for flips would hide real bugs. The trace removes
the discontinuity from the comparison:

- **record** (``debug.routing_record``, the reference run): every MoE layer writes the experts it
  chose for every token of every step to ``run.dir/routing/step-<N>.pt`` -- an int tensor
  (MoE layers, tokens of the global batch, k), indexed by the token's position in the global batch
  (sequence ``g`` of the step, position ``s``: ``g * seq_len + s``).
- **replay** (``debug.routing_replay = <reference run.dir>``, each layout): every MoE layer routes
  each token to the reference's experts, weighted by its *own* scores for them (so gradients flow
  as usual). With the same discrete decisions, the layout must match the reference within the
  summation-order tolerance: a pass means the computation matches, a fail means a bug.
- **report**: while replaying, each layer also computes its own top-k and counts the tokens where it
  differs from the reference, with the score gap (own top-k scores minus the replayed experts'
  scores, >= 0). Near-ties have gaps at rounding level; a gap far above it means the layout's
  router computes something else. Each rank writes ``run.dir/routing/replay-rank<R>.json``.

Each rank knows the global position of its tokens: its micro-batches' first global row (the data
loader), the context-parallel shard of the positions (the same sharding as the tokens), and the
tensor-parallel sequence shard an MoE block runs on. Forwards of a micro-batch happen in order on
every stage and schedule; activation-checkpointing recomputes take the indices back in the same
order.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from shardwise.config.schema import ConfigError
from shardwise.models.moe import MoE, moe_layers

TRACE_DIR = "routing"


def token_positions(first_row: int, rows: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """(rows, seq_len) positions in the global batch of a micro-batch starting at ``first_row``."""
    r = torch.arange(first_row, first_row + rows, device=device)
    return r[:, None] * seq_len + torch.arange(seq_len, device=device)  # (B, S)


class RoutingTrace:
    """Records or replays every MoE layer's expert choices; see the module docstring."""

    def __init__(self, model: nn.Module, run_dir: Path, replay_from: str, seq_len: int,
                 global_batch: int, rank: int, tp: tuple[int, int],
                 cp_shard: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.layers: dict[MoE, int] = {m: int(name.split(".")[1]) for name, m in model.named_modules()
                                       if isinstance(m, MoE)}
        self.out = run_dir / TRACE_DIR
        self.replay_dir = Path(replay_from) / TRACE_DIR if replay_from else None
        self.seq_len, self.tokens, self.rank = seq_len, global_batch * seq_len, rank
        self.tp_rank, self.tp = tp
        self.cp_shard = cp_shard
        self.step = 0
        self.positions: list[torch.Tensor] = []  # per micro-batch, (B, S local): this step's tokens
        self.calls: dict[MoE, int] = {}
        self.pending: dict[MoE, collections.deque] = {}  # positions to hand to recomputes, in order
        self.record: dict[int, torch.Tensor] = {}
        self.reference: dict[int, torch.Tensor] = {}
        self.stats = {"tokens": 0, "differ": 0, "max_gap": 0.0, "steps": {}}
        for m in self.layers:
            m.routing = self
        if self.replay_dir is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self._meta = {"global_batch": global_batch, "seq_len": seq_len, "steps": 0}

    @contextlib.contextmanager
    def around_step(self, step: int, batches: list, positions: list[torch.Tensor] | None = None
                    ) -> Iterator[None]:
        """Make ``batches``' token positions known to the MoE layers for the step's forwards; after
        it, write the step's record (reference) or count its differences (replay). ``positions``: each
        micro-batch's, given where a batch's ``first_row`` is not every rank's (simulated ranks)."""
        if positions is None:
            device, positions = batches[0].inputs.device, []
            for b in batches:  # (the unsharded micro-batches: positions are sharded here like tokens)
                pos = token_positions(b.first_row, b.inputs.shape[0], self.seq_len, device)
                positions.append(self.cp_shard(pos) if self.cp_shard is not None else pos)
        self.step, self.positions = step, positions
        self.calls = dict.fromkeys(self.layers, 0)
        self.pending = {m: collections.deque() for m in self.layers}
        if self.replay_dir is not None:
            saved = torch.load(self.replay_dir / f"step-{step}.pt", weights_only=True)
            self.reference = {layer: saved["ids"][i] for i, layer in enumerate(saved["layers"])}
        else:
            self.record = {layer: torch.full((self.tokens, m.top_k), -1, dtype=torch.int32)
                           for m, layer in self.layers.items()}
        yield
        if self.replay_dir is None:
            layers = sorted(self.record)
            torch.save({"layers": layers, "ids": torch.stack([self.record[k] for k in layers])},
                       self.out / f"step-{step}.pt")
            self._meta["steps"] = step
            (self.out / "meta.json").write_text(json.dumps(self._meta))

    def choose(self, layer: MoE, biased: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """The expert ids (T, k) ``layer`` routes its T local tokens to: its own (recorded) or the
        reference's (replayed). ``biased``: its routing scores (T, E); ``own``: its top-k (T, k)."""
        recompute = torch._C._current_graph_task_id() != -1  # inside backward: AC recomputing
        if recompute:
            pos = self.pending[layer].popleft()
        else:
            pos = self.positions[self.calls[layer]]
            self.calls[layer] += 1
            pos = pos.chunk(self.tp, dim=1)[self.tp_rank] if self.tp > 1 else pos  # the block's shard
            pos = pos.flatten()  # (T,)
            self.pending[layer].append(pos)
        n = self.layers[layer]
        if self.replay_dir is None:
            if not recompute:
                self.record[n][pos.cpu()] = own.to(torch.int32).cpu()
            return own
        forced = self.reference[n][pos.cpu()].to(device=own.device, dtype=own.dtype)  # (T, k)
        if not recompute:
            with torch.no_grad():
                differ = (own.sort(-1).values != forced.sort(-1).values).any(-1)  # (T,)
                self._tally(differ, layer.router.choice_gap(biased, own, forced))
        return forced

    def _tally(self, differ: torch.Tensor, gap: torch.Tensor) -> None:
        """Count a forward's replayed tokens whose own top-k differs (``differ`` (T,)) and their largest
        score gap (``gap`` (T,)), as tensors: read once, when the trace closes."""
        s = self.stats
        s["tokens"] += differ.numel()
        if differ.numel():
            n = differ.sum()
            s["differ"] = s["differ"] + n
            s["max_gap"] = torch.maximum(torch.as_tensor(s["max_gap"]), torch.where(differ, gap, 0).max())
            s["steps"][str(self.step)] = s["steps"].get(str(self.step), 0) + n

    def detach(self) -> None:
        """The MoE layers route on their own again."""
        for m in self.layers:
            m.routing = None

    def close(self) -> None:
        self.detach()
        if self.replay_dir is not None:
            s = self.stats
            steps = {k: int(v) for k, v in s["steps"].items() if int(v)}
            report = {"tokens": int(s["tokens"]), "differ": int(s["differ"]), "max_gap": float(s["max_gap"]),
                      "steps": steps}
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"replay-rank{self.rank}.json").write_text(json.dumps(report))


def read_meta(run_dir: Path) -> dict:
    """The trace header of a recording run (batch shape, steps recorded); one-line error if none."""
    try:
        return json.loads((run_dir / TRACE_DIR / "meta.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"debug.routing_replay: '{run_dir}' holds no routing trace "
                          f"({TRACE_DIR}/meta.json): point it at the run.dir of a run with "
                          "debug.routing_record=true") from None


def replay_report(run_dir: Path) -> dict:
    """Every rank's replay statistics of ``run_dir`` summed: routed token-layer pairs, how many the
    layout's own router would have sent elsewhere, the largest score gap among them."""
    total = {"tokens": 0, "differ": 0, "max_gap": 0.0}
    for f in sorted((run_dir / TRACE_DIR).glob("replay-rank*.json")):
        s = json.loads(f.read_text())
        total["tokens"] += s["tokens"]
        total["differ"] += s["differ"]
        total["max_gap"] = max(total["max_gap"], s["max_gap"])
    return total


def routing_trace(model: nn.Module, **kwargs) -> RoutingTrace | None:  # noqa: ANN003
    """A :class:`RoutingTrace` on ``model``'s MoE layers, or None when it has none."""
    return RoutingTrace(model, **kwargs) if moe_layers(model) else None
