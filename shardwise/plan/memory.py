"""Per-rank memory of a training step: activations per op, and the peak of a step's timeline.

Activations come from :mod:`shardwise.plan.activations` (per op, per block).

**Peak** (:func:`step_memory`): a timeline of one steady-state step (optimizer states allocated,
gradients freed by the previous step) at the granularity of FSDP units and blocks: all-gathers
allocate unsharded parameters (and their gather buffer while copying out), forward keeps the saved
activations, the loss holds the logits and their fp32 gradient temporaries, backward frees a
block's activations as it finishes and allocates its unsharded gradient and reduce-scatter buffers;
pipeline ranks hold their schedule's in-flight micro-batches. The maximum of the running total is
the predicted peak, reported with the phase where it happens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.config.schema import Config
from shardwise.parallel.stages import stage_layers
from shardwise.plan.activations import (
    Shape,
    attention_linears,
    backward_temporaries,
    block_activations,
    block_saved,
    embedding_saved,
    expert_rows,
    head_saved,
    loss_temporaries,
    rope_table_bytes,
    shape_of,
)
from shardwise.plan.schedule import schedule_actions
from shardwise.plan.states import BYTES, RankStates
from shardwise.resolve.run import ResolvedRun

# ---------------------------------------------------------------------------------------------
# Pipeline: micro-batches in flight


@dataclass
class Timeline:
    """Running total of live bytes; remembers the peak, where it happened and its parts."""

    live: int = 0
    peak: int = 0
    where: str | tuple = ""
    log: list[dict[str, int]] = field(default_factory=list)
    """Bytes by part of each step applied, in order: the peak's parts are summed from it once, at
    the end (a pipeline replays thousands of steps; copying the parts at each new peak cost more
    than the replay)."""
    at: tuple[int, dict[str, int]] = (0, {})
    """(steps applied before the peak, bytes by part of the peak's step up to its high point)."""

    def add(self, part: str, nbytes: int, where: str | tuple) -> None:
        """One allocation (or, negative, a free). ``where`` may be a tuple: :func:`_where` formats
        it once, for the peak only."""
        if nbytes > 0 and self.live + nbytes > self.peak:
            self.peak, self.where, self.at = self.live + nbytes, where, (len(self.log), {part: nbytes})
        self.live += nbytes
        self.log.append({part: nbytes})

    def run(self, events: list[tuple[str, int]], times: int, where: str | tuple) -> None:
        """Apply ``events`` (part, bytes) ``times`` times over, e.g. one block's for a run of
        identical blocks: the peak of the repetition is in its first pass if a pass frees more
        than it allocates, else in its last, so one pass over the events finds it."""
        self.apply(repeat(one_pass(events), times), where)

    def apply(self, p: Pass | None, where: str | tuple) -> None:
        """Apply a summarized sequence of events (:func:`one_pass`, :func:`repeat`, :func:`then`)."""
        if p is None:
            return
        total, parts, best, best_parts = p
        if self.live + best > self.peak:
            self.peak, self.where, self.at = self.live + best, where, (len(self.log), best_parts)
        self.live += total
        self.log.append(parts)

    @property
    def peak_parts(self) -> dict[str, int]:
        """Live bytes by part at the peak."""
        steps, last = self.at
        out: dict[str, int] = {}
        for parts in [*self.log[:steps], last]:
            for k, v in parts.items():
                out[k] = out.get(k, 0) + v
        return out


Pass = tuple[int, dict[str, int], int, dict[str, int]]
"""A sequence of allocations summarized: (net bytes, net bytes by part, the highest running total,
the running total by part there). Applying one is what applying its events one by one does."""


def _plus(a: dict[str, int], b: dict[str, int], times: int = 1) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + times * v
    return out


def one_pass(events: list[tuple[str, int]]) -> Pass | None:
    """``events`` (part, bytes) applied once, summarized (None: no events)."""
    total, parts, best, best_parts = 0, {}, None, {}
    for part, n in events:
        total += n
        parts[part] = parts.get(part, 0) + n
        if best is None or total > best:
            best, best_parts = total, dict(parts)
    return None if best is None else (total, parts, best, best_parts)


def repeat(p: Pass | None, times: int) -> Pass | None:
    """``p`` applied ``times`` times in a row: its highest point is in the first pass if a pass
    frees more than it allocates, else in the last."""
    if p is None or times <= 0:
        return None
    if times == 1:
        return p
    total, parts, best, best_parts = p
    j = times - 1 if total > 0 else 0
    return times * total, _plus({}, parts, times), j * total + best, _plus(best_parts, parts, j)


def then(a: Pass | None, b: Pass | None) -> Pass | None:
    """``a`` then ``b`` (an equal high point later does not move the first one)."""
    if a is None or b is None:
        return a or b
    total, parts = a[0] + b[0], _plus(a[1], b[1])
    if a[2] >= a[0] + b[2]:
        return total, parts, a[2], a[3]
    return total, parts, a[0] + b[2], _plus(a[1], b[3])


@dataclass(frozen=True)
class RankMemory:
    """Predicted memory of one rank, bytes."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    """Saved for backward at the peak (all in-flight micro-batches)."""
    peak: int
    peak_at: str
    peak_parts: dict[str, int]


def _runs(layers: list[int], signature: dict[int, tuple]) -> list[list[int]]:
    """Consecutive layers grouped into runs of identical signature."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and signature[runs[-1][-1]] == signature[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _rank_activations(cfg: Config, s: Shape, st: RankStates) -> tuple[dict[int, int], dict[int, int],
                                                                     dict[str, int]]:
    """(saved bytes per block under checkpointing, without it, the rank's saved bytes by part) for
    one micro-batch."""
    kinds = {}  # the formulas depend on the block's kind and checkpointing only
    per_block, full_block = {}, {}
    for i in st.layers:
        key = (s.args.is_moe_layer(i), _ac_kind(cfg, i))
        if key not in kinds:
            kinds[key] = (block_activations(s, cfg, i), block_saved(s, cfg, i))
        per_block[i], full_block[i] = kinds[key]
    acts = {"blocks": sum(per_block.values()) + (rope_table_bytes(s, cfg) if st.layers else 0),
            "embedding": embedding_saved(s) if st.has_embedding else 0,
            "head": head_saved(s, cfg) if st.has_head else 0}
    return per_block, full_block, acts


def memory_floor(run: ResolvedRun, st: RankStates) -> int:
    """A lower bound of :func:`step_memory`'s peak, without replaying the step: what is live when
    the first backward starts, counting only allocations that nothing frees before it (parameter
    and optimizer shards, the RoPE table, and one micro-batch's saved activations and loss
    temporaries; under pp the gathered units and the warm-up forwards' activations). The planner
    drops a layout whose floor is over capacity before timing its pipeline (most of the search's
    cost on large models, where most layouts do not fit)."""
    cfg = run.cfg
    s = shape_of(run)
    per_block, _, acts = _rank_activations(cfg, s, st)
    base = st.params + st.optimizer + rope_table_bytes(s, cfg)
    if run.dims.pp == 1:
        loss = loss_temporaries(s, cfg) if st.has_head else 0
        return base + acts["embedding"] + sum(per_block.values()) + acts["head"] + loss
    gathered = sum(s.e * u.numel for u in st.units)
    n_stages = run.dims.pp * run.stages_per_rank
    per_stage = stage_layers(s.args.n_layers, n_stages)
    warmup = 0
    for kind, stage in schedule_actions(run.pipeline, run.micro_batches, st.pp_rank):
        if kind != "F":
            break
        warmup += ((acts["embedding"] if stage == 0 else 0) + (acts["head"] if stage == n_stages - 1 else 0)
                   + sum(per_block[i] for i in per_stage[stage]))
    return base + gathered + warmup


def step_memory(run: ResolvedRun, st: RankStates) -> RankMemory:
    """Simulate one steady-state step of the rank with states ``st``; its peak and breakdown."""
    cfg = run.cfg
    s = shape_of(run)
    e, red = s.e, BYTES[cfg.parallel.fsdp_reduce_dtype] if s.e == 2 else 4
    m = run.micro_batches
    per_block, full_block, acts = _rank_activations(cfg, s, st)
    units: dict[int | None, list] = {}
    for u in st.units:
        units.setdefault(u.layer, []).append(u)
    tl = Timeline()
    tl.add("params", st.params, "start")
    tl.add("optimizer", st.optimizer, "start")
    tl.add("buffers", rope_table_bytes(s, cfg), "start")

    def gather(us: list, where: str) -> None:
        tl.run(_gather_events(us, e), 1, where)

    if run.dims.pp > 1:
        _pipeline_timeline(tl, run, st, s, m, per_block, full_block, acts, gather)
    elif st.plain:
        _plain_timeline(tl, run, st, s, per_block, full_block, acts)
    else:
        order = list(st.layers)
        # One-unit model (parallel/fsdp.py one_unit): the root gathers every block with itself; a
        # block's gradients appear in its backward and wait for the root's reduce at the end.
        held = {i: n for u in units.get(None, []) for i, n in u.blocks}
        sig = {i: (per_block[i], full_block[i], tuple((u.numel, u.reshard) for u in units.get(i, [])),
                   held.get(i, 0)) for i in order}
        ends = acts["embedding"]  # (the RoPE table attention saves is the model's buffer)
        # Micro-batches after the second repeat it exactly (gradients exist from the first on).
        for mb in range(min(m, 2)):
            first = mb == 0
            tag = f" (micro-batch {mb + 1}/{m})" if m > 1 else ""
            gather(units.get(None, []), "forward root" + tag)
            tl.add("activations", ends, "forward" + tag)
            for run in _runs(order, sig):
                us = units.get(run[0], [])
                events = _gather_events(us, e) + [("activations", per_block[run[0]])]
                events += [("unsharded params", -e * u.numel) for u in us if u.reshard]
                tl.run(events, len(run), f"forward {_span(run)}" + tag)
            tl.add("activations", acts["head"], "loss" + tag)
            tl.add("loss", loss_temporaries(s, cfg), "loss backward" + tag)
            tl.add("loss", -loss_temporaries(s, cfg), "loss backward" + tag)
            tl.add("activations", -acts["head"], "loss backward" + tag)
            for run in _runs(list(reversed(order)), sig):
                i, us = run[0], units.get(run[0], [])
                recompute = full_block[i] - per_block[i]  # checkpointed: the forward runs again
                temps = backward_temporaries(s, i)
                events = _gather_events([u for u in us if u.reshard], e) + [("recompute", recompute)]
                # the weight gradients appear while the block's gradient temporaries are alive
                events += [("unsharded grads", e * u.numel) for u in us]
                events += [("unsharded grads", e * held[i])] if i in held else []
                events += [("backward temporaries", temps), ("backward temporaries", -temps)]
                events += _reduce_events(us, e, red, first) + [("recompute", -recompute),
                                                               ("activations", -per_block[i])]
                events += [("unsharded params", -e * u.numel) for u in us]
                tl.run(events, len(run), f"backward {_span(run)}" + tag)
            tl.add("activations", -ends, "backward root" + tag)
            root = units.get(None, [])
            own = [e * (u.numel - sum(n for _, n in u.blocks)) for u in root]  # held blocks' are there
            tl.run([("unsharded grads", n) for n in own] + _reduce_events(root, e, red, first)
                   + [("unsharded params", -e * u.numel) for u in root], 1, "backward root" + tag)
    saved = tl.peak_parts.get("activations", 0)
    return RankMemory(st.pp_rank, st.params, st.grads, st.optimizer, saved, tl.peak, _where(tl.where),
                      tl.peak_parts)


def _plain_timeline(tl: Timeline, run: ResolvedRun, st: RankStates, s: Shape, per_block: dict[int, int],
                    full_block: dict[int, int], acts: dict[str, int]) -> None:
    """A model without FSDP (``RankStates.plain``): each part's fp32 gradients appear in its backward
    on the first micro-batch (later ones add into them) and stay until the step; the fused loss
    hands the head's over in its backward. Eager, autocast's bf16 copy of each block's weights is
    saved for backward (under compile the backward casts again)."""
    cfg = run.cfg
    grads = dict(st.plain)
    head = s.args.vocab_size * s.args.dim if st.has_head else 0
    copies = {i: 0 if run.compile or s.e == 4 else s.e * n for i, n in grads.items() if i is not None}
    # (the plain loss's output projection too; the chunked loss casts the head inside, saving none)
    head_copy = 0 if run.compile or s.e == 4 or s.loss_chunk else s.e * head
    order = list(st.layers)
    sig = {i: (per_block[i], full_block[i], grads[i]) for i in order}
    for mb in range(min(run.micro_batches, 2)):  # micro-batches after the second repeat it exactly
        first = mb == 0
        tag = f" (micro-batch {mb + 1}/{run.micro_batches})" if run.micro_batches > 1 else ""
        tl.add("activations", acts["embedding"], "forward" + tag)
        for r in _runs(order, sig):
            tl.run([("activations", per_block[r[0]]), ("autocast copies", copies[r[0]])], len(r),
                   f"forward {_span(r)}" + tag)
        tl.run([("activations", acts["head"]), ("autocast copies", head_copy)], 1, "loss" + tag)
        tl.add("loss", loss_temporaries(s, cfg), "loss backward" + tag)
        tl.add("loss", -loss_temporaries(s, cfg), "loss backward" + tag)
        tl.add("grads", 4 * head if first else 0, "loss backward" + tag)
        tl.run([("activations", -acts["head"]), ("autocast copies", -head_copy)], 1, "loss backward" + tag)
        for r in _runs(list(reversed(order)), sig):
            i = r[0]
            recompute, temps = full_block[i] - per_block[i], backward_temporaries(s, i)
            events = [("recompute", recompute), ("grads", 4 * grads[i] if first else 0),
                      ("backward temporaries", temps), ("backward temporaries", -temps),
                      ("recompute", -recompute), ("activations", -per_block[i]),
                      ("autocast copies", -copies[i])]
            tl.run(events, len(r), f"backward {_span(r)}" + tag)
        tl.add("activations", -acts["embedding"], "backward root" + tag)
        tl.add("grads", 4 * (grads[None] - head) if first else 0, "backward root" + tag)


def _where(where: str | tuple) -> str:
    """A timeline position for people: a pipeline pass is kept as (phase, stage, pass)."""
    return where if isinstance(where, str) else f"{where[0]} (stage {where[1]}, pass {where[2]})"


def _ac_kind(cfg: Config, layer: int) -> str:
    ac = cfg.activation_checkpoint
    if ac.mode == "layer":
        return "full" if layer % ac.every == 0 else "none"
    return ac.mode


def _span(run: list[int]) -> str:
    return f"layers.{run[0]}" if len(run) == 1 else f"layers.{run[0]}..{run[-1]}"


def _gather_events(units: list, e: int) -> list[tuple[str, int]]:
    """An FSDP all-gather: the unsharded parameters, and the gather output while it is copied out."""
    out = []
    for u in units:
        out += [("unsharded params", e * u.numel), ("fsdp buffers", e * u.numel),
                ("fsdp buffers", -e * u.numel)]
    return out


def _reduce_events(units: list, e: int, red: int, first: bool) -> list[tuple[str, int]]:
    """A reduce-scatter of the unsharded gradients (already counted): its reduce-dtype input buffer,
    and on the first micro-batch the sharded gradient it allocates -- while the unsharded gradients
    are still alive (FSDP2 drops its references after the copy-in, autograd's go after the
    collective: measured with one unit holding the whole model, where the order sets the peak).
    Later micro-batches reduce into a new output that is then added to the sharded gradient."""
    out = []
    for u in units:
        output = ("grads", 4 * u.numel // u.shard) if first else ("fsdp buffers", red * u.numel // u.shard)
        out += [("fsdp buffers", red * u.numel), output, ("unsharded grads", -e * u.numel)]
        out += [] if first else [("fsdp buffers", -output[1])]
        out.append(("fsdp buffers", -red * u.numel))
    return out


def weight_inputs(s: Shape, layer: int) -> int:
    """What a block keeps between its input-gradient and weight-gradient passes (zero-bubble
    schedules): the inputs of its linear layers."""
    a = s.args
    # the attention input, the MLP's, and attention's other linear inputs (wo's; the latents)
    rest = sum(x.inp for x in attention_linears(a, s.tp) if not x.reads_hidden)
    n = 2 * s.e * s.tokens * a.dim + s.e * s.tokens * rest
    if a.is_moe_layer(layer):
        return n + s.e * expert_rows(s) * a.moe_hidden_dim
    return n + s.e * s.tokens * a.ffn_hidden_dim // s.tp


def _stage_backward(s: Shape, layers: list[int], per_block: dict[int, int], full_block: dict[int, int],
                    grads: dict[int | None, int], first: bool) -> Pass | None:
    """A pipeline stage's backward over its blocks, runs of identical blocks folded; ``first``: the
    stage's unsharded gradients appear with it."""
    sig = {i: (per_block[i], full_block[i], grads.get(i, 0)) for i in layers}
    out = None
    for run in _runs(list(reversed(layers)), sig):
        i = run[0]
        recompute, temps = full_block[i] - per_block[i], backward_temporaries(s, i)
        events = [("unsharded grads", grads.get(i, 0))] if first else []
        events += [("recompute", recompute), ("backward temporaries", temps),
                   ("backward temporaries", -temps), ("recompute", -recompute),
                   ("activations", -per_block[i])]
        out = then(out, repeat(one_pass(events), len(run)))
    return out


def _pipeline_timeline(tl: Timeline, run: ResolvedRun, st: RankStates, s: Shape, m: int,
                       per_block: dict[int, int], full_block: dict[int, int], acts: dict[str, int],
                       gather) -> None:  # noqa: ANN001
    """A pipeline rank's step: its units stay gathered; each forward adds its stage's activations
    for one micro-batch, each backward frees them (block by block the first time, which also
    allocates the stage's gradients: they accumulate unsharded in the reduce dtype until the one
    reduce-scatter at the end, torch's schedules syncing gradients on the last micro-batch only)."""
    cfg = run.cfg
    red = BYTES[cfg.parallel.fsdp_reduce_dtype] if s.e == 2 else 4
    units = list(st.units)
    gather(units, "forward")
    grads: dict[int | None, int] = {}
    for u in units:
        grads[u.layer] = grads.get(u.layer, 0) + red * u.numel
    n_stages = run.dims.pp * run.stages_per_rank
    per_stage = stage_layers(s.args.n_layers, n_stages)
    loss = loss_temporaries(s, cfg) if st.has_head else 0
    stage_acts, keep = {}, {}
    for stage in {x for _, x in schedule_actions(run.pipeline, m, st.pp_rank)}:
        ends = (acts["embedding"] if stage == 0 else 0) + (acts["head"] if stage == n_stages - 1 else 0)
        stage_acts[stage] = ends + sum(per_block[i] for i in per_stage[stage])
        keep[stage] = sum(weight_inputs(s, i) for i in per_stage[stage])
    done: set[int | None] = set()  # stages whose gradients exist (None: the root's)
    backward: dict[tuple, Pass | None] = {}  # a stage's backward, the same every micro-batch

    def root_grads(stage: int, where: str) -> None:
        """Mark the stage's gradients allocated; the embedding / head ones with the first of them."""
        done.add(stage)
        if None not in done and stage in (0, n_stages - 1):
            tl.add("unsharded grads", grads.get(None, 0), where)
            done.add(None)

    for n, (kind, stage) in enumerate(schedule_actions(run.pipeline, m, st.pp_rank)):
        where = ("forward" if kind == "F" else "backward", stage, n + 1)
        if kind == "F":
            tl.add("activations", stage_acts[stage], where)
            continue
        if kind == "W":  # weight gradients: the kept linear inputs go, the gradients may appear
            key = (stage, stage in done, kind)
            if key not in backward:
                new = [("unsharded grads", grads.get(i, 0)) for i in per_stage[stage] if stage not in done]
                backward[key] = one_pass(new + [("activations", -keep[stage])])
            tl.apply(backward[key], where)
            root_grads(stage, where)
            continue
        first = kind == "B" and stage not in done  # (this backward allocates the stage's gradients)
        if (stage, first, kind) not in backward:  # the loss's, the blocks', then the stage's ends
            head = one_pass([("loss", loss), ("loss", -loss)]) if stage == n_stages - 1 else None
            ends = stage_acts[stage] - sum(per_block[i] for i in per_stage[stage])
            tail = one_pass([("activations", -ends + (keep[stage] if kind == "I" else 0))])
            blocks = _stage_backward(s, per_stage[stage], per_block, full_block, grads, first)
            backward[stage, first, kind] = then(then(head, blocks), tail)
        tl.apply(backward[stage, first, kind], where)
        if kind == "B":
            root_grads(stage, where)
    # at the end of the schedule the gradients are reduce-scattered
    reduce = [(("grads", 4 * u.numel // u.shard), ("unsharded grads", -red * u.numel)) for u in units]
    tl.run([event for pair in reduce for event in pair], 1, "gradient reduction")
