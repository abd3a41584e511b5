"""``shardwise estimate``: per-rank memory, communication and step time of one concrete layout."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.model_args import ModelArgs
from shardwise.config.schema import Config, model_label
from shardwise.observe.flops import flops_per_token, num_params
from shardwise.plan.comm import Collective, step_collectives
from shardwise.plan.cost import StepTime, step_time
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import Layout
from shardwise.plan.memory import RankMemory, step_memory
from shardwise.plan.overlap import collective_time
from shardwise.plan.states import ParamShapes, RankStates, built_states, shape_states
from shardwise.resolve.run import ResolvedRun, resolve_run

GiB = 2**30


@dataclass(frozen=True)
class Estimate:
    run: ResolvedRun
    hardware: Hardware
    states: tuple[RankStates, ...]
    memory: tuple[RankMemory, ...]
    collectives: tuple[tuple[Collective, ...], ...]
    """Per pipeline rank."""
    time: StepTime

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @property
    def layout(self) -> Layout:
        return Layout.of(self.run)

    @property
    def peak(self) -> int:
        """The largest predicted peak over the ranks."""
        return max(m.peak for m in self.memory)

    @property
    def reserved(self) -> float:
        """What the device's allocator is predicted to reserve at that peak (GPUs: the live peak
        times ``RESERVED_OVER_LIVE``)."""
        return self.hardware.reserved(self.peak)

    @property
    def fits(self) -> bool:
        return self.reserved <= self.hardware.memory_gib * GiB

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.time.tokens_per_s / self.run.world

    @property
    def mfu(self) -> float:
        """PaLM-convention MFU against the hardware's peak for the run's dtype (0 on ``local``)."""
        peak = self.hardware.peak_tflops.get(self.run.precision, 0.0)
        if not peak:
            return 0.0
        per_token = flops_per_token(self.run.model, self.cfg.training.seq_len)
        return self.tokens_per_s_per_device * per_token / (peak * 1e12)


def estimate(cfg: Config, world: int, hw: Hardware, exact: bool = True,
             shapes: ParamShapes | None = None) -> Estimate:
    """Estimate ``cfg`` on ``world`` ranks of ``hw``: the run resolved as the trainer resolves it
    (e.g. the pipeline's micro-batch when none is set), so what is estimated is what ``shardwise
    train`` would run; then :func:`estimate_run`."""
    return estimate_run(resolve_run(cfg, world, detect_device=False), hw, exact, shapes)


def estimate_run(run: ResolvedRun, hw: Hardware, exact: bool = True,
                 shapes: ParamShapes | None = None) -> Estimate:
    """Memory, communication and step time of ``run`` on ``hw``. ``exact``: states from the real
    model built on the fake process group (else from shapes, for searching many layouts)."""
    states = built_states(run) if exact else shape_states(run, shapes)
    memory = tuple(step_memory(run, st) for st in states)
    colls = tuple(tuple(step_collectives(run, st)) for st in states)
    return Estimate(run, hw, tuple(states), memory, colls, step_time(run, states, hw))


def _gib(n: float) -> str:
    return f"{n / GiB:.3f}"


def shape_line(cfg: Config, args: ModelArgs) -> str:
    """What a plan or estimate is for: the model (``args``, what ``cfg`` resolves to), the sequence,
    the sequences and tokens per step, the precision (``plan`` and ``estimate`` both start with it)."""
    t = cfg.training
    f8 = f" + float8 linears ({cfg.float8.recipe})" if cfg.float8.enabled else ""
    n = num_params(args)
    size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    return (f"model {model_label(cfg.model)} ({size} params), sequence {t.seq_len:,}, "
            f"{t.global_batch} sequences = {t.global_batch * t.seq_len:,} tokens per step, "
            f"{t.mixed_precision}{f8}, optimizer states {cfg.optimizer.state_dtype}")


def format_estimate(est: Estimate) -> str:
    """The estimate as a few plain-text tables."""
    cfg, lay, hw = est.cfg, est.layout, est.hardware
    lines = [shape_line(cfg, est.run.model),
             f"layout {lay} on {lay.world} ranks ({est.run.micro_batches} micro-batch(es) per "
             f"rank), hardware {hw.name}: {hw.description}", ""]
    heads = [f"pp rank {m.pp_rank}" for m in est.memory]
    rows = [("parameters (fp32 shards)", [m.params for m in est.memory]),
            ("gradients", [m.grads for m in est.memory]),
            ("optimizer states", [m.optimizer for m in est.memory])]
    parts = sorted({k for m in est.memory for k in m.peak_parts} - {"params", "optimizer"})
    rows += [(f"at peak: {k}", [m.peak_parts.get(k, 0) for m in est.memory]) for k in parts]
    rows.append(("peak", [m.peak for m in est.memory]))
    width = max(len(r[0]) for r in rows) + 2
    lines.append(f"memory per rank, GiB (capacity {hw.memory_gib:g})")
    lines.append(" " * width + "".join(f"{h:>14}" for h in heads))
    for label, values in rows:
        lines.append(f"{label:<{width}}" + "".join(f"{_gib(v):>14}" for v in values))
    lines.append(f"{'peak happens at':<{width}}" + "".join(f"  {m.peak_at}" for m in est.memory))
    if not hw.cores:
        lines.append(f"{'reserved (allocator)':<{width}}" + "".join(f"{_gib(hw.reserved(m.peak)):>14}"
                                                                    for m in est.memory))
    lines += ["", "communication per step, pp rank 0 (buffer bytes as --debug.comm counts them)",
              "| mesh dim | collective | phase | calls | MiB | ms | what |", "|---|---|---|---|---|---|---|"]
    for (group, kind, phase, what), (calls, nbytes, secs) in comm_table(est).items():
        lines.append(f"| {group} | {kind} | {phase} | {calls} | {nbytes / 2**20:.3f} | {1e3 * secs:.2f} | "
                     f"{what} |")
    st = est.time
    lines += ["", "step time, seconds"]
    for r in st.ranks:
        comp = ", ".join(f"{k} {v:.3f}" for k, v in r.compute.items() if v)
        comm = sum(r.comm.values())
        lines.append(f"  pp rank {r.pp_rank}: compute {sum(r.compute.values()):.3f} ({comp}); "
                     f"communication {comm:.3f}, exposed {r.exposed_comm:.3f}")
    if "compute" in st.extra:
        lines.append(f"  {lay.world} ranks share {hw.cores} cores: ranks waiting in the bubble lend theirs, "
                     f"so the step's compute is {st.extra['compute']:.3f} (cost.shared_cores_pipeline)")
    if lay.pp > 1:
        lines.append(f"  pipeline bubble {st.bubble:.3f}")
    mfu = f", MFU {100 * est.mfu:.1f}%" if est.mfu else ""
    lines.append(f"  step {st.step:.3f} s -> {st.tokens_per_s:,.0f} tokens/s, "
                 f"{est.tokens_per_s_per_device:,.0f} per device{mfu}")
    if not est.fits:
        lines.append(f"  does not fit: {'reserved' if not hw.cores else 'peak'} {_gib(est.reserved)} GiB > "
                     f"{hw.memory_gib:g} GiB")
    return "\n".join(lines)


def comm_table(est: Estimate, pp_rank: int = 0) -> dict[tuple[str, str, str, str], list]:
    """(mesh dim, collective, phase, what) -> [calls, bytes, seconds] of one pipeline rank, the
    per-unit FSDP rows summed."""
    out: dict[tuple[str, str, str, str], list] = {}
    for c in est.collectives[pp_rank]:
        row = out.setdefault((c.group, c.kind, c.phase, c.what), [0, 0, 0.0])
        row[0] += c.calls
        row[1] += c.total
        row[2] += collective_time(c, est.run.dims.degrees, est.hardware, pp_rank)
    return out


def estimate_json(est: Estimate) -> str:
    """The estimate as JSON (bytes and seconds), for scripts."""
    import dataclasses
    import json

    data = {
        "layout": dataclasses.asdict(est.layout), "world": est.layout.world, "hardware": est.hardware.name,
        "memory": [dataclasses.asdict(m) for m in est.memory],
        "comm": [{"mesh_dim": g, "collective": k, "phase": p, "what": w, "calls": n, "bytes": b,
                  "seconds": t} for (g, k, p, w), (n, b, t) in comm_table(est).items()],
        "time": {"step_s": est.time.step, "bubble_s": est.time.bubble, "tokens_per_s": est.time.tokens_per_s,
                 "tokens_per_s_per_device": est.tokens_per_s_per_device, "mfu": est.mfu,
                 "ranks": [dataclasses.asdict(r) for r in est.time.ranks]},
    }
    return json.dumps(data, indent=1)
