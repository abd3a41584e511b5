"""``shardwise plan``: enumerate layouts -> drop the infeasible -> cost -> choose.

The candidates are :class:`~shardwise.plan.layout.Layout` values over pp, dp_replicate, dp_shard, cp,
tp, ep, the pipeline schedule, the micro-batch and the activation-checkpointing mode. A layout is
dropped, with its reason counted, when the trainer would refuse it (degrees that do not divide the
model, the batch or the sequence; ``ParallelDims`` and the preflight checks decide, the same code
``shardwise train`` runs) or when its predicted peak memory exceeds the device's capacity. The rest
are costed on shapes (:func:`~shardwise.plan.states.shape_states`, milliseconds each, pipeline ranks
first and last only) and ranked by predicted tokens/s per device; the best ones are then estimated
on every pipeline rank, the first (the one written out) from the real model on the fake process
group. A layout whose memory floor (:func:`~shardwise.plan.memory.memory_floor`) is already over
capacity is dropped before its step is replayed, and of the checkpointing modes that fit one layout
only the fastest is costed (the others recompute more for the same traffic).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import itertools
import multiprocessing
from collections import Counter
from dataclasses import dataclass, field

import torch

from shardwise.config.model_args import ModelArgs
from shardwise.config.schema import Config, ConfigError, model_label, preset_toml, read_config
from shardwise.models.presets import FAMILY_TOKENIZERS
from shardwise.plan.cost import step_time
from shardwise.plan.estimate import Estimate, GiB, estimate_run, shape_line
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import Layout
from shardwise.plan.memory import memory_floor, step_memory
from shardwise.plan.states import ParamShapes, bounding_pp_ranks, param_shapes, shape_states
from shardwise.resolve.run import ResolvedRun, resolve_model
from shardwise.runtime.machine import usable_cores

AC_MODES = ("none", "selective", "selective_half", "full")
MEMORY_ORDER = ("full", "selective_half", "selective", "none", "layer")
"""Checkpointing modes from the least activation memory (and the most recompute) up."""
SCHEDULES = ("1f1b", "interleaved1f1b", "zbv")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    peak: int
    tokens_per_s_per_device: float

    def __str__(self) -> str:
        return (f"{self.layout}: {self.tokens_per_s_per_device:,.0f} tok/s/device, "
                f"peak {self.peak / GiB:.1f} GiB")


@dataclass
class PlanResult:
    model: ModelArgs
    """The model planned (the config's, resolved once)."""
    ranked: list[Candidate]
    dropped: Counter
    """Reason -> how many layouts it removed."""
    considered: int
    top: list[Estimate]
    """Exact estimates of the best few."""
    refusals: dict[str, str] = field(default_factory=dict)
    """Reason -> one of the trainer's messages behind it."""
    least: tuple[Layout, int, bool] | None = None
    """Of the layouts over capacity, the one needing the least memory: (layout, bytes the allocator
    reserves, whether they are at the peak or only at the floor the peak is at least)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(args: ModelArgs, gpus: int, hw: Hardware, ac_modes: tuple[str, ...] = AC_MODES,
                      schedules: tuple[str, ...] = SCHEDULES, max_micro_batch: int = 8) -> list[Layout]:
    """Every layout of model ``args`` on ``gpus`` ranks worth costing: tp and cp inside a node, any
    pp, dp split into replicas x shards, expert parallel for MoE models, micro-batches up to
    ``max_micro_batch``."""
    node = hw.gpus_per_node if not hw.cores else gpus
    out = []
    for tp, cp in itertools.product(divisors(node), repeat=2):
        if tp * cp > node or gpus % (tp * cp):
            continue
        for pp in divisors(gpus // (tp * cp)):
            if pp > args.n_layers:
                continue
            dp = gpus // (tp * cp * pp)
            for dp_replicate in divisors(dp):
                dp_shard = dp // dp_replicate
                for ep in (divisors(dp_shard * cp * tp) if args.n_experts else [1]):
                    for sched in (schedules if pp > 1 else ("1f1b",)):
                        for mb in (b for b in divisors(max_micro_batch) if b <= max_micro_batch):
                            for ac in ac_modes:
                                out.append(Layout(pp, dp_replicate, dp_shard, cp, tp, ep, sched, 2, mb, ac))
    return out


def layout_refusal(cfg: Config, layout: Layout) -> str:
    """'' if the trainer accepts ``layout`` for ``cfg``, else its one-line refusal."""
    run = _resolved(cfg, layout, resolve_model(cfg))
    return run if isinstance(run, str) else ""


def _resolved(cfg: Config, layout: Layout, args: ModelArgs) -> ResolvedRun | str:
    """The run of ``layout`` for ``cfg`` (whose model is ``args``), or the trainer's one-line refusal
    of it."""
    try:
        return layout.resolve(cfg, args)
    except ConfigError as e:
        return str(e)


def _reason(message: str) -> str:
    """A short bucket for a refusal message (the config key it names)."""
    words = [w for w in message.replace("=", " ").split() if "." in w and w[0].isalpha()]
    return f"not accepted: {words[0]}" if words else "not accepted"


PARALLEL_GROUPS = 200
"""Searches of at least this many layout groups run on the usable cores (forked workers, Linux)."""


@dataclass
class _Found:
    """What searching some layout groups found, in their order."""

    ranked: list[Candidate] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    refusals: dict[str, str] = field(default_factory=dict)
    least: tuple[Layout, int, bool] | None = None

    def over(self, layout: Layout, need: int, at_peak: bool) -> None:
        """A layout over capacity: kept if it needs the least so far (the first of equals)."""
        if not (self.least and self.least[1] <= need):
            self.least = (layout, need, at_peak)

    def merge(self, later: _Found) -> None:
        """Append what the groups after these found, as one search in order would have."""
        self.ranked += later.ranked
        self.dropped.update(later.dropped)
        for reason, message in later.refusals.items():
            self.refusals.setdefault(reason, message)
        if later.least:
            self.over(*later.least)


def _search(cfg: Config, args: ModelArgs, gpus: int, hw: Hardware, capacity: float, shapes: ParamShapes,
            groups: list[list[Layout]]) -> _Found:
    """Check, bound and cost ``groups`` of layouts that differ only in their checkpointing mode.
    Within a group, less memory costs more recompute: the modes are tried from the least memory up
    until one is over capacity (those needing more are over too), then from the fastest down until
    one fits (the slower ones that also fit are dominated: same traffic, more compute, so never
    ranked above it)."""
    found, states_cache = _Found(), {}
    for group in groups:
        # the trainer's checks (resolve_run) never read the checkpointing mode: one verdict per group
        if isinstance(first := _resolved(cfg, group[0], args), str):
            found.dropped[_reason(first)] += len(group)
            found.refusals.setdefault(_reason(first), first)
            continue
        key = dataclasses.astuple(group[0])[:7]  # the degrees and the schedule: the states
        if key not in states_cache:
            # Pipeline ranks in between hold fewer micro-batches than the first and no head: the
            # first rank of each kind of stage and the last bound the peak and the time during the
            # search (on local ranks sharing cores every rank's work counts:
            # cost.shared_cores_pipeline).
            pp = group[0].pp
            ends = None if pp <= 2 or hw.cores else bounding_pp_ranks(first)
            states_cache[key] = shape_states(first, shapes, ends)
        states = states_cache[key]
        runs = {group[0]: first}  # each mode's run (resolved alike: its checks passed above)
        below = []  # under capacity at the floor, least memory first
        for i, layout in enumerate(sorted(group, key=lambda x: MEMORY_ORDER.index(x.ac))):
            if layout not in runs:
                runs[layout] = layout.resolve(cfg, args)
            run = runs[layout]
            # capacity holds what the allocator reserves for the live bytes (hw.reserved)
            if (need := int(hw.reserved(max(memory_floor(run, st) for st in states)))) > capacity:
                found.dropped["memory over capacity"] += len(group) - i
                found.over(layout, need, False)
                break
            below.append(layout)
        for i, layout in enumerate(reversed(below)):  # fastest first
            run = runs[layout]
            peak = max(step_memory(run, st).peak for st in states)
            if (need := int(hw.reserved(peak))) > capacity:
                found.dropped["memory over capacity"] += 1
                found.over(layout, need, True)
                continue
            t = step_time(run, states, hw)
            found.ranked.append(Candidate(layout, peak, t.tokens_per_s / gpus))
            if rest := len(below) - i - 1:
                found.dropped["slower than a checkpointing mode that fits"] += rest
            break
    return found


def plan(cfg: Config, gpus: int, hw: Hardware, top: int = 5, memory_fraction: float = 0.9,
         ac_modes: tuple[str, ...] = AC_MODES, schedules: tuple[str, ...] = SCHEDULES,
         exact_top: bool = True, workers: int = 0) -> PlanResult:
    """Rank the layouts of ``cfg``'s model and batch on ``gpus`` devices of ``hw``. ``workers``:
    processes to search with (0: the usable cores, at most 8, for searches of at least
    ``PARALLEL_GROUPS`` groups; the result is the same either way)."""
    capacity = hw.memory_gib * GiB * memory_fraction
    args = resolve_model(cfg)
    shapes = param_shapes(args)
    layouts = enumerate_layouts(args, gpus, hw, ac_modes, schedules)
    groups = [list(g) for _, g in itertools.groupby(layouts, key=lambda x: dataclasses.replace(x, ac="none"))]
    workers = workers or (min(8, usable_cores()) if len(groups) >= PARALLEL_GROUPS else 1)
    search = functools.partial(_search, cfg, args, gpus, hw, capacity, shapes)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        # contiguous chunks (neighbouring groups share their states), several per worker for balance
        n = min(len(groups), 4 * workers)
        chunks = [groups[len(groups) * i // n:len(groups) * (i + 1) // n] for i in range(n)]
        # A forked child holds copies of the caller's objects but not its other threads: it must not
        # finalize what the caller left for its garbage collector (a process group's or a thread
        # pool's destructor waits on threads the child lacks: it hangs or crashes), nor use the
        # caller's OpenMP pool. So the caller collects first and freezes the rest, as the gc module
        # advises before a fork, and each worker computes on one thread, as DataLoader workers do.
        gc.collect()
        gc.freeze()
        try:
            with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads,
                                                          initargs=(1,)) as pool:
                parts = pool.map(search, chunks, chunksize=1)
        finally:
            gc.unfreeze()
        found = parts[0]
        for part in parts[1:]:
            found.merge(part)
    else:
        found = search(groups)
    ranked = sorted(found.ranked, key=lambda x: -x.tokens_per_s_per_device)
    # The first is the one written out: its states come from the real model (tests hold the shape
    # rules equal to it, so the others are costed from shapes -- a 405B build takes 1-3 s on 2 cores).
    exact = [estimate_run(x.layout.resolve(cfg, args), hw, exact=exact_top and i == 0, shapes=shapes)
             for i, x in enumerate(ranked[:top])]
    return PlanResult(args, ranked, found.dropped, len(layouts), exact, found.refusals, found.least)


def fits_on(cfg: Config, gpus: int, hw: Hardware, memory_fraction: float = 0.9, grow_batch: bool = True,
            most: int = 65536) -> tuple[int, Candidate] | None:
    """The fewest devices -- ``gpus`` times a power of two, up to ``most`` -- on which some layout
    of ``cfg`` fits, with the fastest such layout (a quick search: full checkpointing and 1F1B
    only, which need the least memory); None if none does. ``grow_batch``: one sequence per
    device, as plan's default batch is (else the batch stays)."""
    cfg = copy.deepcopy(cfg)
    n = 2 * gpus
    while n <= most:
        if grow_batch:
            cfg.training.global_batch = max(cfg.training.global_batch, n)
        result = plan(cfg, n, hw, top=0, memory_fraction=memory_fraction, ac_modes=("full",),
                      schedules=("1f1b",), exact_top=False)
        if result.ranked:
            return n, result.ranked[0]
        n *= 2
    return None


def why_nothing(result: PlanResult, cfg: Config, gpus: int, hw: Hardware, memory_fraction: float,
                batch_from_gpus: bool) -> str:
    """One line on why no layout was left, and what would fit."""
    label, usable = model_label(cfg.model), hw.memory_gib * memory_fraction
    if result.least is None:  # every layout refused: the most common reason, in the trainer's words
        reason = result.dropped.most_common(1)[0][0] if result.dropped else ""
        return (f"no layout of {label} on {gpus} x {hw.name} is accepted: "
                f"{result.refusals.get(reason, 'no candidate layouts')}")
    layout, need, exact = result.least
    head = (f"no layout of {label} fits on {gpus} x {hw.name} ({usable:.1f} GiB usable per device): the "
            f"least memory is {'' if exact else 'at least '}{need / GiB:.1f} GiB per device ({layout})")
    found = fits_on(cfg, gpus, hw, memory_fraction, grow_batch=batch_from_gpus)
    if found is None:
        return head + "; shorten --seq or the batch, or use devices with more memory"
    n, best = found
    need = hw.reserved(best.peak) / GiB
    return head + (f"; it fits on {n} x {hw.name} ({best.layout}, {need:.1f} GiB), or "
                   "shorten --seq or the micro-batch")


def parse_tokens(text: str) -> int:
    """'4M' -> 4194304, '512K' -> 524288, '1000000' -> 1000000 (binary multiples, as batch sizes
    are quoted)."""
    t = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise ConfigError(f"--global-batch-tokens '{text}': expected a number like 4M or 524288") from None


def shape_differs(cfg: Config) -> str:
    """A line when the planned sequence or batch differs from the preset's own TOML, else ""."""
    path = preset_toml(cfg.model.name)
    if path is None:
        return ""
    ref, t = read_config(path).training, cfg.training
    if (ref.seq_len, ref.global_batch) == (t.seq_len, t.global_batch):
        return ""
    return (f"this plan's shape (sequence {t.seq_len:,}, {t.global_batch} sequences per step) differs from "
            f"{path.name}'s (sequence {ref.seq_len:,}, {ref.global_batch} sequences per step)")


def data_note(cfg: Config) -> str:
    """What the written config trains on when it names no data or tokenizer of its own."""
    if cfg.data.synthetic:  # (it reads neither)
        return ""
    family = FAMILY_TOKENIZERS.get(cfg.model.name)
    if family and not cfg.data.tokenizer:
        return (f"{cfg.model.name} trains with the {family} tokenizer: run the written config with "
                "--data.tokenizer DIR (a folder with its tokenizer.json) and --data.path DATA")
    if cfg.data.path or cfg.data.sources:
        return ""
    shipped = "chat set" if cfg.data.format == "chat" else "4 MB KJV corpus"
    tokenizer = "" if cfg.data.tokenizer else " with the shipped 2048-token tokenizer"
    return (f"data.path is not set, so this config trains on the shipped {shipped}{tokenizer}: plan "
            "--config your.toml keeps your data, tokenizer, optimizer and checkpoint sections")


def plan_config(base: Config, seq: int, global_batch_tokens: int) -> Config:
    """``base`` with the sequence length and the global batch (in sequences) of the plan."""
    if global_batch_tokens < seq or global_batch_tokens % seq:
        raise ConfigError(f"--global-batch-tokens {global_batch_tokens} must be a multiple of --seq {seq} "
                          "(whole sequences per step)")
    cfg = base
    cfg.training.seq_len = seq
    cfg.training.global_batch = global_batch_tokens // seq
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq)
    return cfg


def format_plan(result: PlanResult, cfg: Config, gpus: int, hw: Hardware) -> str:
    lines = [shape_line(cfg, result.model),
             f"{result.considered} layouts of {model_label(cfg.model)} on {gpus} x {hw.name}: "
             f"{len(result.ranked)} feasible"]
    for reason, n in result.dropped.most_common():
        lines.append(f"  dropped {n}: {reason}")
    lines += ["", "| # | layout | tok/s/device | MFU | peak GiB | reserved GiB | step s | compute s | "
                  "exposed comm s | bubble s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, est in enumerate(result.top, 1):
        t = est.time
        compute = t.extra.get("compute", max(sum(r.compute.values()) for r in t.ranks))
        comm = max(r.exposed_comm for r in t.ranks)
        mfu = f"{100 * est.mfu:.1f}%" if est.mfu else "-"
        lines.append(f"| {i} | {est.layout} | {est.tokens_per_s_per_device:,.0f} | {mfu} | "
                     f"{est.peak / GiB:.1f} | {est.reserved / GiB:.1f} | {t.step:.3f} | {compute:.3f} | "
                     f"{comm:.3f} | {t.bubble:.3f} |")
    return "\n".join(lines)


def run_command(path: str, gpus: int, hw: Hardware) -> str:
    """How to launch the written config on ``gpus`` devices of ``hw``: local ranks through
    ``--nproc``; GPUs through torchrun, with c10d rendezvous across nodes."""
    if hw.cores:
        return f"shardwise train --config {path}" + (f" --nproc {gpus}" if gpus > 1 else "")
    per_node = min(gpus, hw.gpus_per_node)
    nodes = -(-gpus // per_node)
    if nodes == 1:
        return f"torchrun --nproc-per-node {per_node} -m shardwise train --config {path}"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:29500 -m shardwise train --config {path}  (on each node)")


def layout_toml(est: Estimate, path: str, notes: tuple[str, ...] = ()) -> str:
    """The chosen layout as a ready-to-run config, with the prediction (and ``notes``) in a header
    comment."""
    head = (f"# shardwise plan: {est.layout} on {est.layout.world} x {est.hardware.name}\n"
            f"# predicted {est.tokens_per_s_per_device:,.0f} tokens/s per device, step "
            f"{est.time.step:.3f} s, peak memory {est.peak / GiB:.1f} GiB per device"
            + (f" ({est.reserved / GiB:.1f} GiB reserved by the allocator)" if not est.hardware.cores else "")
            + "\n"
            f"# run: {run_command(path, est.layout.world, est.hardware)}\n")
    return head + "".join(f"# note: {n}\n" for n in notes) + est.cfg.to_toml()
