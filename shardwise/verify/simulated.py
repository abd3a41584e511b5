"""``verify --ranks N``: a layout trained as N simulated ranks in this process
(:mod:`shardwise.trainer.simulate`), from the reference's seed weights, on the same data, and
compared with the reference as a real layout is.

What runs is the trainer's own: the rank model built by ``build_step_parts`` (meta -> parallelize
-> materialize -> init), each data-parallel rank's ``PackedLoader``, the context-parallel cut, and
``train_step`` (loss, backward, gradient clipping, optimizer, schedule). What a session adds around
them -- run folder, logs, checkpoints, evaluation -- does not run: the simulated run's losses and
parameters are read in memory. Every rank's loss is compared (each holds the all-reduced figure), and
every rank's full copy of each parameter (a rank whose replica drifted fails the layout). Under
pipeline parallel each pipeline rank's slice of ranks trains its own stages (:func:`simulate.on_ranks`),
and every reference parameter must be held by some rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.config.schema import Config, ConfigError
from shardwise.data.dataset import Batch
from shardwise.models.transformer import load_full_weights
from shardwise.observe.capture import StepCapture, plain_copy
from shardwise.observe.comm import CommTracker, mesh_group_names
from shardwise.observe.routing import RoutingTrace, routing_trace, token_positions
from shardwise.ops.cpu_bf16 import use_fp32_gemms_for_bf16
from shardwise.parallel.dims import Mesh, ParallelDims
from shardwise.resolve.preflight import with_data
from shardwise.resolve.run import ResolvedRun, resolve_run
from shardwise.runtime.machine import environment_kept
from shardwise.trainer import simulate
from shardwise.trainer.session import StepParts, build_loader, build_step_parts, open_run_corpus
from shardwise.trainer.train import set_determinism, train_step
from shardwise.verify.distance import tensor_update_error, update_sums

MAX_RANKS = 1024
"""The most simulated ranks a layout may name."""


@dataclass(frozen=True)
class SimulatedRun:
    """A layout's simulated run, read in memory."""

    losses: list[dict[int, float]]
    """Per step, every rank's loss of the global batch."""
    param_rel: float
    """max over ranks and tensors of ||p_rank - p_ref|| / ||p_ref - p_seed||."""
    worst: str
    """The tensor (and rank) of ``param_rel``."""
    step_seconds: list[float]
    """Each step's wall time (the first pays FSDP's lazy initialization)."""
    peak_rss_gib: float
    """This process's peak resident memory so far."""
    mesh: dict[str, int]
    """The mesh torch built (every dim's and view's size, ``ParallelDims.built_sizes``)."""
    states: dict[int, dict[str, int]]
    """Each rank's bytes of parameters and optimizer states after the last step (as
    ``observe.memory.state_bytes`` counts a real rank's)."""
    collectives: list[dict[str, dict[str, int]]]
    """Per pipeline rank, the bytes per mesh dim and collective its first rank issued in the last
    step (``--debug.comm``'s totals, which the planner's table is held to)."""
    routing: dict | None = None
    """MoE, replaying the reference's routing: {tokens, differ, max_gap} over every rank, as
    ``replay_report`` sums a real run's."""

    @property
    def seconds_per_step(self) -> float:
        """The mean step time, the first step's lazy initialization left out when there are more."""
        later = self.step_seconds[1:] or self.step_seconds
        return sum(later) / len(later)


def check_simulated(run: ResolvedRun) -> None:
    """Refuse in one line what the simulation does not carry yet."""
    d, cfg = run.dims, run.cfg
    if d.world_size > MAX_RANKS:
        raise ConfigError(f"--ranks simulates at most {MAX_RANKS} ranks; the layout has {d.world_size}")
    missing = [what for what, on in (
        ("context parallel (cp > 1)", d.cp > 1),
        ("float8 (float8.enabled)", cfg.float8.enabled),
        ("compile (compile.enabled=true)", cfg.compile.enabled is True),
        ("a fine-tune's initial weights (checkpoint.initial_hf)", bool(cfg.checkpoint.initial_hf)),
    ) if on]
    if missing:
        raise ConfigError(f"verify --ranks does not simulate {', '.join(missing)} yet: verify that layout "
                          "with real ranks (--nproc)")


def train_simulated(cfg: Config, world: int, steps: int, seed: dict[str, torch.Tensor],
                    ref: dict[str, torch.Tensor] | None, capture: Path | None = None) -> SimulatedRun:
    """Train ``steps`` steps of ``cfg`` (a layout of ``world`` ranks) as simulated ranks from the
    ``seed`` weights; compare every rank's final parameters with ``ref``'s (None: not compared, as
    for a capture alone). ``capture``: step 1's
    module outputs and gradients are written there, one file per simulated rank, as
    ``debug.capture`` writes a real rank's (``verify --localize``). The calling process's
    environment is left as it was (a rank's setup writes variables into its own: deterministic
    cuBLAS, torch's compile cache)."""
    with environment_kept():
        return _train_simulated(cfg, world, steps, seed, ref, capture)


def _train_simulated(cfg: Config, world: int, steps: int, seed: dict[str, torch.Tensor],
                     ref: dict[str, torch.Tensor] | None, capture: Path | None) -> SimulatedRun:
    if cfg.compile.enabled == "auto":  # (a long run's auto would compile: simulated ranks run eager)
        cfg = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, enabled=False))
    run = resolve_run(cfg, world, detect_device=False)
    check_simulated(run)
    run = with_data(run)
    corpus = open_run_corpus(run)
    use_fp32_gemms_for_bf16("cpu", run.precision)  # as train() sets this process up
    with simulate.simulated_ranks(world):
        run.dims.build_mesh("cpu")
        slices = simulate.stage_slices(run.dims.submesh(Mesh.PP))
        # (pipeline parallel: each pipeline rank's slice of ranks trains its own stages, in a thread)
        parts = simulate.on_ranks(slices, lambda: _train_slice(run, corpus, steps, seed, ref, capture))
    losses = [{r: v for p in parts for r, v in p.losses[i].items()} for i in range(steps)]
    seconds = [max(p.seconds[i] for p in parts) for i in range(steps)]
    states = {r: v for p in parts for r, v in p.states.items()}
    worst = max((p.worst for p in parts), key=lambda w: w[0])
    if missing := sorted(set(ref or {}) - {n for p in parts for n in p.names}):
        # (a stage split that lost a block, say: no rank trains these)
        worst = (math.inf, f"{missing[0]} (held by no rank; {len(missing)} missing)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (KiB on Linux)
    routing = None
    if run.cfg.debug.routing_replay:
        routing = {"tokens": sum(p.routing["tokens"] for p in parts),
                   "differ": sum(p.routing["differ"] for p in parts),
                   "max_gap": max(p.routing["max_gap"] for p in parts)}
    return SimulatedRun(losses, worst[0], worst[1], seconds, rss, run.dims.built_sizes(), states,
                        [p.collectives for p in parts], routing)


def simulated_states(cfg: Config, world: int) -> dict[int, dict[str, int]]:
    """Every simulated rank's parameter and optimizer-state bytes (:func:`rank_states`) of ``cfg``'s
    layout of ``world`` ranks, without training it: the trainer's rank model is built (meta ->
    parallelize -> materialize -> init) and its optimizer creates its states in one step on zero
    gradients (a state's shape is its parameter's shard's, whatever the gradient)."""
    run = resolve_run(cfg, world, detect_device=False)
    check_simulated(run)
    with environment_kept(), simulate.simulated_ranks(world):
        run.dims.build_mesh("cpu")
        slices = simulate.stage_slices(run.dims.submesh(Mesh.PP))
        parts = simulate.on_ranks(slices, lambda: _slice_states(run))
    return {r: v for p in parts for r, v in p.items()}


def _slice_states(run: ResolvedRun) -> dict[int, dict[str, int]]:
    parts = build_step_parts(run, "cpu")
    for p in parts.model.parameters():
        p.grad = torch.zeros_like(p)
    parts.optimizer.step()
    return rank_states(parts.model, parts.optimizer)


@dataclass
class _Slice:
    """What one slice of simulated ranks (all ranks, or one pipeline rank's) trained."""

    losses: list[dict[int, float]]
    seconds: list[float]
    states: dict[int, dict[str, int]]
    names: set[str]
    worst: tuple[float, str]
    collectives: dict[str, dict[str, int]]
    routing: dict | None


def _train_slice(run: ResolvedRun, corpus: object, steps: int, seed: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor] | None, capture: Path | None) -> _Slice:
    """The trainer's step parts on the simulated ranks of the calling ``LocalTensorMode``, trained
    ``steps`` steps from ``seed`` (step 1 captured into ``capture``, if given)."""
    set_determinism(run.cfg.debug.deterministic, run.cfg.training.seed)
    parts = build_step_parts(run, "cpu")
    load_full_weights(parts.model, seed)
    dp_of = simulate.coordinates(run.dims.submesh(Mesh.DP), 0)
    loaders = {d: build_loader(run, corpus, d, "cpu") for d in sorted(set(dp_of.values()))}  # (this slice's)
    losses, seconds = [], []
    # (the last step's collectives, as --debug.comm counts a real rank's: per step, not per module)
    tracker = CommTracker(mesh_group_names(run.dims.mesh, run.dims.flat_meshes), track_modules=False)
    trace = _routing_trace(run, parts.model)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        per_dp = {d: ld.next_step() for d, ld in loaders.items()}
        batches = rank_batches(per_dp, dp_of)
        with contextlib.ExitStack() as stack:
            if trace is not None:
                stack.enter_context(trace.around_step(step, batches, rank_positions(run, per_dp, dp_of)))
            if step == steps:
                stack.enter_context(tracker)
            if capture is not None and step == 1:
                stack.enter_context(RankCapture.around(capture, parts, run, per_dp, dp_of, batches))
            result = train_step(parts.model, parts.optimizer, parts.scheduler, parts.shard(batches), run,
                                parts.loss, parts.pipe)
        losses.append(simulate.every_rank(result.loss))
        seconds.append(time.perf_counter() - t0)
    names = set(_trained(parts.model, ref or {}))
    worst = param_error(parts.model, ref, seed) if ref is not None else (0.0, "not compared")
    return _Slice(losses, seconds, rank_states(parts.model, parts.optimizer), names, worst,
                  tracker.totals(), _replayed(trace))


class RankCapture(StepCapture):
    """``debug.capture`` of one step on every simulated rank of a slice: each rank's file is the one
    a real rank of the layout writes (its rows, its sequence positions, its local outputs; the
    gradients from the rank at coordinate 0 of every dim but the pipeline's)."""

    def _place(self, dims: ParallelDims, seq_len: int, load_balance: bool) -> None:
        dp_of = simulate.coordinates(dims.submesh(Mesh.DP), 0)
        tp_of = _tp_of(dims, dp_of)
        with simulate.plain():  # (each rank's own plain tensor; cp is refused under --ranks)
            self.rank_positions = {r: torch.arange(seq_len).chunk(dims.tp)[tp_of[r]] for r in dp_of}
        self.positions = next(iter(self.rank_positions.values()))  # (the hook's length check)
        self.writers = {r for r in dp_of if dp_of[r] == 0 and tp_of[r] == 0}
        self.writes_grads, self.rank_rows = True, {}  # (a gradient's gather is every rank's collective)

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def _save(self) -> None:
        def mine(t: torch.Tensor, r: int) -> torch.Tensor:
            return plain_copy(simulate.every_rank_tensor(t)[r]).clone()  # (not the storage it views)
        for r, positions in self.rank_positions.items():
            with simulate.plain():
                torch.save({"rows": self.rank_rows[r], "positions": positions,
                            "outputs": [(n, c, mine(t, r)) for n, c, t in self.outputs],
                            "grads": {n: (mine(g, r), d) for n, (g, d) in self.grads.items()}
                            if r in self.writers else {}}, self.out / f"rank{r}.pt")

    @classmethod
    @contextlib.contextmanager
    def around(cls, out: Path, parts: StepParts, run: ResolvedRun, per_dp: dict[int, list[Batch]],
               dp_of: dict[int, int], batches: list[Batch]) -> Iterator[None]:
        """Capture the step of ``batches`` (each rank's rows from its data-parallel rank's)."""
        cap = cls(out, parts.model, parts.optimizer, run.dims, run.cfg.training.seq_len, run.model.dim,
                  run.cfg.parallel.cp_load_balance, rank=-1)
        cap.rank_rows = {r: [(b.first_row, b.inputs.shape[0]) for b in per_dp[d]] for r, d in dp_of.items()}
        try:
            with cap.around_step(batches):
                yield
        finally:
            cap.close()


def _routing_trace(run: ResolvedRun, model: torch.nn.Module) -> RoutingTrace | None:
    """With debug.routing_replay: the reference's expert choices replayed on the slice's MoE layers,
    each rank's tokens found by their positions (:func:`rank_positions`)."""
    if not run.cfg.debug.routing_replay:
        return None
    t = run.cfg.training
    return routing_trace(model, run_dir=Path(run.cfg.run.dir), replay_from=run.cfg.debug.routing_replay,
                         seq_len=t.seq_len, global_batch=t.global_batch, rank=0, tp=(0, 1), cp_shard=None)


def rank_positions(run: ResolvedRun, per_dp: dict[int, list[Batch]], dp_of: dict[int, int]
                   ) -> list[torch.Tensor]:
    """Each micro-batch's token positions in the global batch as one simulated tensor: rank r's are
    its data-parallel rank's rows, cut to its tensor-parallel sequence shard, the tokens an MoE block
    routes there ((B, S / tp) per rank; a real rank's trace cuts them as it routes)."""
    tp, tp_of = run.dims.tp, _tp_of(run.dims, dp_of)
    out, seq, cpu = [], run.cfg.training.seq_len, torch.device("cpu")
    for i, first in enumerate(next(iter(per_dp.values()))):
        rows = first.inputs.shape[0]
        with simulate.plain():  # (each rank's own plain tensor)
            own = {r: token_positions(per_dp[d][i].first_row, rows, seq, cpu).chunk(tp, dim=1)[tp_of[r]]
                   for r, d in dp_of.items()}
        out.append(simulate.from_ranks(own))
    return out


def _tp_of(dims: ParallelDims, ranks: dict[int, int]) -> dict[int, int]:
    """{simulated rank: its tensor-parallel index} for ``ranks``' keys (0 without TP)."""
    return simulate.coordinates(dims.submesh(Mesh.TP), 0) if dims.tp > 1 else dict.fromkeys(ranks, 0)


def _replayed(trace: RoutingTrace | None) -> dict | None:
    """The replay's statistics summed over the slice's ranks (None without a replay)."""
    if trace is None:
        return None
    trace.detach()
    s = trace.stats
    differ, gaps = (simulate.every_rank(torch.as_tensor(s[k])) for k in ("differ", "max_gap"))
    return {"tokens": s["tokens"] * len(differ), "differ": int(sum(differ.values())),
            "max_gap": max(gaps.values())}


def rank_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, int]]:
    """{rank: {"params": bytes, "optimizer": bytes}} of every simulated rank's local shards
    (``state_bytes``'s rule: Adam's one-element step counters aside)."""
    out: dict[int, dict[str, int]] = {}
    states = [v for st in optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.numel() > 1]
    for key, tensors in (("params", list(model.parameters())), ("optimizer", states)):
        for t in tensors:
            for rank, local in simulate.every_rank_tensor(t).items():
                held = out.setdefault(rank, {"params": 0, "optimizer": 0})
                held[key] += local.numel() * local.element_size()
    return out


def rank_batches(per_dp: dict[int, list[Batch]], dp_of: dict[int, int]) -> list[Batch]:
    """Each micro-batch as one simulated batch: rank r holds its data-parallel rank's (``dp_of[r]``)."""
    out, first = [], next(iter(per_dp.values()))
    for i in range(len(first)):
        mine = {r: per_dp[d][i] for r, d in dp_of.items()}
        docs = first[i].doc_ids is not None
        out.append(Batch(simulate.from_ranks({r: b.inputs for r, b in mine.items()}),
                         simulate.from_ranks({r: b.labels for r, b in mine.items()}),
                         simulate.from_ranks({r: b.doc_ids for r, b in mine.items()}) if docs else None,
                         simulate.from_ranks({r: torch.tensor(b.n_valid) for r, b in mine.items()}),
                         first[i].first_row))
    return out


@torch.no_grad()
def param_error(model: torch.nn.Module, ref: dict[str, torch.Tensor], seed: dict[str, torch.Tensor]
                ) -> tuple[float, str]:
    """max over every rank and parameter of ``tensor_update_error`` of the rank's full copy, and
    where it is. A sharded parameter is never gathered (that is N full copies at once: 67 GB of a
    128,256-row embedding over 512 ranks): each rank measures its own shard against the same cut of
    the reference, and the sums are all-reduced over the mesh dims that shard it."""
    names = _trained(model, ref)
    if missing := sorted(set(names) - set(ref)):
        raise ValueError(f"the reference checkpoint lacks parameters {missing[:5]}")
    worst, where = 0.0, ""
    for name, p in names.items():  # one parameter at a time
        for rank, err in _rank_errors(p, ref[name], seed[name]).items():
            if not err <= worst:  # (NaN is worst)
                worst, where = err if not math.isnan(err) else math.inf, f"{name} (rank {rank})"
    return worst, where


def _trained(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's parameters, and the buffers its checkpoint keeps (an MoE router's expert bias,
    which training moves): what the reference's weights are compared on."""
    return {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if n in ref}}


def _rank_errors(p: torch.Tensor, ref: torch.Tensor, seed: torch.Tensor) -> dict[int, float]:
    """{rank: ``tensor_update_error`` of its full copy of ``p``}."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(p, DTensor):  # (every rank holds all of it)
        with maybe_disable_local_tensor_mode():
            return {r: tensor_update_error(v, ref, seed) for r, v in simulate.every_rank_tensor(p).items()}
    mesh, placements = p.device_mesh, p.placements
    # The reference cut as the parameter is: DTensor's own split of a replicated tensor, rank by rank.
    cut = [simulate.every_rank_tensor(DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
                                      .redistribute(mesh, placements)) for t in (ref, seed)]
    mine = simulate.every_rank_tensor(p)
    with maybe_disable_local_tensor_mode():
        sums = {r: torch.stack(update_sums(v, cut[0][r], cut[1][r])) for r, v in mine.items()}
    totals = DTensor.from_local(simulate.from_ranks(sums), mesh,
                                [Replicate() if pl.is_replicate() else Partial() for pl in placements],
                                run_check=False).full_tensor()  # (each rank: its copy's sums)
    return {r: math.sqrt(float(t[0])) / max(math.sqrt(float(t[1])), 1e-30)
            for r, t in simulate.every_rank_tensor(totals).items()}
