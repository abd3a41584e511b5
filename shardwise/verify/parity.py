"""``shardwise verify``: prove that parallel layouts train the same run as one device.

1. The reference trains K steps on 1 rank and saves its initialized state as a seed checkpoint
   (``step-0``) and its final state (``step-K``).
2. Each layout loads that seed checkpoint -- DCP reshards it onto the layout -- and trains the
   same K steps on the same global batch, in deterministic mode. The K steps are the run's first
   (``training.stop_after``): its own learning-rate schedule, not one compressed into K steps.
3. Per-step losses are compared, and the final parameters per tensor relative to how far training
   moved them: ``||p_layout - p_ref|| / ||p_ref - p_seed||``.
4. bf16: the reference is rerun on its rank with its batch's gradient summed in halves and in
   quarters, and with TP's split matmuls when a layout has TP -- the run's own noise floor
   (:func:`noise_floor`); a bound below :data:`FLOOR_FACTOR` times it is raised. fp32: the same,
   only once a layout meets every bound but the parameters' (Adam's first update near its eps).
5. A table with pass/fail against the tolerances below, and an overlay plot of the loss curves.

Every run is a real ``shardwise train`` process (through the same launcher users use).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.checkpoint import read_model_tensors
from shardwise.config.schema import Config, ConfigError
from shardwise.observe.capture import format_localized, localize
from shardwise.observe.metrics import read_metrics
from shardwise.observe.routing import replay_report
from shardwise.parallel.dims import DEGREES, Mesh
from shardwise.resolve.checks import load_config
from shardwise.resolve.layouts import layout_degrees, parse_layout
from shardwise.verify.distance import tensor_update_error
from shardwise.verify.simulated import SimulatedRun, train_simulated


@dataclass(frozen=True)
class Tolerance:
    loss_rel: float
    """Max relative per-step loss difference."""
    param_rel: float
    """Max per-tensor ||p - p_ref|| / ||p_ref - p_seed||."""
    route_gap: float
    """MoE: max score gap of a token whose own top-k differs from the replayed reference's, per stage
    of the routing rule (``Router.choice_gap``; a near-tie is at rounding level: fp32 logits ~1e-7, bf16
    gate outputs ~2^-8 relative, more after steps of drift -- the noise floor measures how much)."""


# fp32: layouts differ only in summation order (collectives, TP partial matmuls). Measured, tiny GQA
# model, 10 steps: loss <= 1.2e-7 rel, params <= 3e-5 of the update.
# bf16: every reordered reduction rounds at bf16's 2^-8 relative precision and the runs drift apart
# chaotically, most in attention wq/wk (the noisiest gradients); TP adds bf16 partial-sum
# reductions. Measured, debug preset without QK-norm, seq 256, 20 steps warming up and decaying within
# them: loss <= 7.3e-4 rel; params <= 2.3e-2 of the update for FSDP2/FSDP4/HSDP2x2/FSDP2xTP2 and 7.2e-2
# for TP2. (On the run's own schedule, near the peak learning rate from step 10, the same layouts end
# up to 0.2 apart: the noise floor below.) Calibrated for runs of ~20 steps:
# fp32 is the proof of a layout, bf16 a guard against gross errors (a learning rate off by a third
# gives loss 1.3e-2 and params 0.38 after 10 steps). A run near a loss spike or with many router
# near-ties drifts many-fold more from the same rounding; the noise floor (below) measures that.
TOLERANCES = {"fp32": Tolerance(loss_rel=1e-5, param_rel=1e-4, route_gap=1e-5),
              "bf16": Tolerance(loss_rel=2e-3, param_rel=0.15, route_gap=2e-2)}

@dataclass
class Result:
    layout: str
    ranks: int
    loss_abs: float
    loss_rel: float
    param_rel: float
    passed: bool
    error: str = ""
    routing: dict | None = None
    """MoE: {tokens, differ, max_gap} of the replay (see shardwise/observe/routing.py)."""


@dataclass(frozen=True)
class Verification:
    """What ``shardwise verify`` found: every layout's distance from the reference and its verdict."""

    results: list[Result]
    """One per layout, in the order given."""
    tolerance: Tolerance
    """The bounds each layout was judged against (in bf16, raised to the noise floor's)."""
    floor: Result | None
    """The run's own noise floor, where it was measured (bf16; fp32 when a layout was past the
    parameter bound alone)."""
    out: Path
    """The runs, their logs and the loss overlay plot."""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)


def _train(args: list[str], nproc: int, log: Path) -> str:
    """Run ``shardwise train``; return '' on success, else the last error line."""
    cmd = [sys.executable, "-m", "shardwise", "train", *args] + ([f"--nproc={nproc}"] if nproc > 1 else [])
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    if proc.returncode == 0:
        return ""
    lines = [ln for ln in log.read_text().splitlines() if "error" in ln.lower()]
    return (lines[-1] if lines else f"exit code {proc.returncode}")[:200]


def run_dirname(layout: str) -> str:
    """A directory name for a layout string: 'tp=2,dp_shard=2' -> 'tp2_dp_shard2'."""
    return layout.replace("=", "").replace(",", "_").replace(".", "-")


def checkpoint_params(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model parameters of a DCP checkpoint, gathered into plain tensors (no process group)."""
    return read_model_tensors(checkpoint)


def update_error(p: dict[str, torch.Tensor], p_ref: dict[str, torch.Tensor],
                 p_start: dict[str, torch.Tensor]) -> float:
    """max over tensors of :func:`tensor_update_error`: how far two runs ended apart, relative to
    how far training moved each tensor."""
    if p.keys() != p_ref.keys():
        raise ValueError(f"parameter names differ: {sorted(p.keys() ^ p_ref.keys())[:5]}")
    return max(tensor_update_error(p[k], p_ref[k], p_start[k]) for k in p_ref)


def verify_layouts(base: Config, config: str | None, overrides: list[str], layouts: list[str], steps: int,
           out: Path, moe_routing: str = "replay", localize_all: bool = False, simulated: bool = False
           ) -> Verification:
    """Run the reference and every layout; print the table; return the verdicts. ``base``: the
    config (``config`` with ``overrides``) of the reference run, loaded and checked by the caller.
    ``moe_routing``: replay the reference's expert choices in MoE layouts, or route freely. In bf16
    the bounds are at least :data:`FLOOR_FACTOR` times the run's own noise floor
    (:func:`noise_floor`). Each failing layout (``localize_all``: every layout) is then localized
    (:func:`localize_layouts`). ``simulated``: each layout trains as simulated ranks in this process
    (:mod:`shardwise.verify.simulated`) instead of as real ones; the reference is a real run."""
    precision = base.training.mixed_precision
    parsed = [(name, *parse_layout(name)) for name in layouts]  # bad layouts fail before any run
    out.mkdir(parents=True, exist_ok=True)
    # The first `steps` steps of the run as configured -- its learning-rate schedule included, which a
    # run shortened to `steps` would compress (a warm-up ending at the last step, a decay within it).
    settings = [*overrides, f"--training.steps={max(base.training.steps, steps)}",
                f"--training.stop_after={steps}", "--debug.deterministic=true", "--eval.interval=0",
                "--checkpoint.interval=0", "--checkpoint.final=true", "--run.overwrite=true",
                "--metrics.log_format=line", "--metrics.tensorboard=false", "--metrics.plot=false"]
    common = ([] if config is None else ["--config", config]) + settings
    ref_dir = out / "reference"
    # MoE: the layouts replay the reference's routing, so that a near-tie one layout breaks the other
    # way cannot decide the verdict; the tokens where a layout's own router differs are reported.
    moe = bool(base.model.n_experts) and moe_routing == "replay"
    print(f"reference: 1 rank, {steps} steps ({precision}{', routing recorded' if moe else ''}) ...",
          flush=True)
    err = _train([*common, f"--run.dir={ref_dir}", "--checkpoint.save_initial=true",
                  *(["--debug.routing_record=true"] if moe else []), *parse_layout("")[0]], 1,
                 out / "reference.log")
    if err:
        raise ConfigError(f"the reference run failed: {err} (log: {out / 'reference.log'})")
    seed = ref_dir / "checkpoints" / "step-0"
    replay = [f"--debug.routing_replay={ref_dir}"] if moe else []
    compare = _Comparison(ref_dir, steps, moe)
    tps = tuple(sorted({layout_degrees(name)[Mesh.TP] for name in layouts} - {1}))
    floor_args = [*common, f"--checkpoint.path={seed}", *replay]
    floor = noise_floor(base, floor_args, out, compare, tps) if precision == "bf16" else None
    tol = floor_bounds(TOLERANCES[precision], floor)
    results = []
    for name, layout_args, world in parsed:
        print(f"{name}: {world} ranks ...", flush=True)
        if simulated:
            r = _simulated(name, world, config, [*settings, *replay, *layout_args], steps, compare)
        else:
            run_dir = out / run_dirname(name)
            err = _train([*common, f"--run.dir={run_dir}", f"--checkpoint.path={seed}", *replay,
                          *layout_args], world, out / f"{run_dir.name}.log")
            r = compare(name, world, run_dir) if not err else Result(name, world, math.nan, math.nan,
                                                                     math.nan, False, err)
        results.append(_judged(r, tol))
    if precision == "fp32" and any(_params_alone(r, tol) for r in results):
        # Adam divides each gradient element by its own size: where gradients are near optimizer.eps,
        # the same sums rounded elsewhere move an update many times more than they move the gradient.
        # Only then is the run's own fp32 noise measured, and the parameter bound judged against it.
        print("fp32: a layout is past the parameter bound alone; measuring this run's own fp32 noise",
              flush=True)
        floor = noise_floor(base, floor_args, out, compare, tps)
        tol = floor_bounds(TOLERANCES[precision], floor, FP32_FLOOR_CAP)
        results = [_judged(r, tol) for r in results]
    print()
    print(format_table(results, tol, precision, floor))
    if floor is not None:
        print(floor_notice(TOLERANCES[precision], tol, floor, precision))
    plot_overlay(compare.curves, out / "loss_overlay.png")
    print(f"\noverlay plot: {out / 'loss_overlay.png'}; logs and runs under {out}")
    chosen = [(*p, not r.passed) for p, r in zip(parsed, results, strict=True)
              if localize_all or not (r.passed or r.error)]
    if chosen:
        capture = None
        if simulated:  # (each layout's step 1 on its simulated ranks, from the same seed)
            def capture(layout_args: list[str], world: int, into: Path) -> None:
                cfg = load_config(config, [*settings, *replay, *layout_args, "--training.stop_after=1"])
                train_simulated(cfg, world, 1, compare.p_seed, None, capture=into)
        localize_layouts([*common, *replay], seed, chosen, out / "localize", precision, capture)
    return Verification(results, tol, floor, out)


def _meets(r: Result, tol: Tolerance, params: bool = True) -> bool:
    """Whether ``r`` is within ``tol``'s loss and routing bounds (and, ``params``, its parameters')."""
    return r.loss_rel <= tol.loss_rel and (not params or r.param_rel <= tol.param_rel) and (
        r.routing is None or r.routing["max_gap"] <= tol.route_gap)


def _judged(r: Result, tol: Tolerance) -> Result:
    """``r`` with its verdict against ``tol`` (a run that failed stays failed)."""
    if not r.error:
        r.passed = _meets(r, tol)
    return r


def _params_alone(r: Result, tol: Tolerance) -> bool:
    """A run that meets every bound but the parameters' one."""
    return not r.error and not _meets(r, tol) and _meets(r, tol, params=False)


def _simulated(name: str, world: int, config: str | None, settings: list[str], steps: int,
               compare: _Comparison) -> Result:
    """Layout ``name`` trained as ``world`` simulated ranks (``config`` with ``settings``: the
    common overrides, then the layout's), compared with the reference; its time per step and the
    peak memory said."""
    cfg = load_config(config, settings)
    sim = train_simulated(cfg, world, steps, compare.p_seed, compare.p_ref)
    mesh = " x ".join(f"{k}={sim.mesh[k]}" for k in DEGREES if sim.mesh.get(k, 1) > 1)
    params = sorted(s["params"] for s in sim.states.values())
    print(f"  {world} simulated ranks on a mesh of {mesh}: {sim.seconds_per_step:.2f} s per step, peak "
          f"memory {sim.peak_rss_gib:.2f} GiB; parameter bytes per rank {params[0]:,}..{params[-1]:,}; "
          f"largest parameter gap at {sim.worst}", flush=True)
    return compare.simulated(name, world, sim)


class _Comparison:
    """A run's distance from the reference: per-step losses, final parameters over the update,
    and (MoE, replayed) where its own routing differs; ``curves`` keeps each run's losses for the plot."""

    def __init__(self, ref_dir: Path, steps: int, moe: bool) -> None:
        self.steps, self.moe = steps, moe
        self.ref_loss = self.loss(ref_dir)
        self.curves = {"reference (1 rank)": self.ref_loss}
        self.p_ref = checkpoint_params(ref_dir / "checkpoints" / f"step-{steps}")
        self.p_seed = checkpoint_params(ref_dir / "checkpoints" / "step-0")

    @staticmethod
    def loss(run_dir: Path) -> list[float]:
        return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]

    def __call__(self, name: str, ranks: int, run_dir: Path, curve: str = "") -> Result:
        loss = self.curves[curve or name] = self.loss(run_dir)
        diffs = [abs(a - b) for a, b in zip(loss, self.ref_loss, strict=True)]
        rel = max(d / abs(b) for d, b in zip(diffs, self.ref_loss, strict=True))
        prel = update_error(checkpoint_params(run_dir / "checkpoints" / f"step-{self.steps}"),
                            self.p_ref, self.p_seed)
        return Result(name, ranks, max(diffs), rel, prel, True,
                      routing=replay_report(run_dir) if self.moe else None)

    def simulated(self, name: str, ranks: int, sim: SimulatedRun) -> Result:
        """A simulated run: every rank's loss at every step against the reference's."""
        if len(sim.losses) != len(self.ref_loss):
            raise ValueError(f"{name}: {len(sim.losses)} simulated steps, the reference has "
                             f"{len(self.ref_loss)}")
        self.curves[name] = [step[min(step)] for step in sim.losses]
        diffs = [abs(v - b) for step, b in zip(sim.losses, self.ref_loss, strict=True) for v in step.values()]
        rel = max(abs(v - b) / abs(b) for step, b in zip(sim.losses, self.ref_loss, strict=True)
                  for v in step.values())
        if any(math.isnan(d) for d in diffs):
            rel = math.inf
        return Result(name, ranks, max(diffs), rel, sim.param_rel, True, routing=sim.routing)


FLOOR_DIR = "floor"
FLOOR_FACTOR = 3.0
"""A layout's bf16 bound is the fixed tolerance or this many times the run's noise floor, the
larger. A layout rounds in more places than any one floor run (more ranks, each of its reductions)
and the floor is one sample of a chaotic drift: measured, before the floor had TP's rounding, the
debug preset's tp=2 ended 3.1x as far from the reference as dp_shard=4, and the MoE presets' layouts
up to 1.9x (parameters) and 2.2x (routing gap) as far as their floors."""
FLOOR_CAP = 2.0
"""The loss and parameter bounds rise to at most this many times the fixed ones: beyond, they would
pass a learning rate off by a third (loss 1.3e-2, params 0.38 after 10 steps); a run noisier than
that is said to be one where a correct layout may fail."""
FP32_FLOOR_CAP = 100.0
"""fp32's parameter bound rises to at most this many times the fixed one (1e-2 of the update): a
model whose gradients sit near optimizer.eps moves Adam's first updates by up to ~1e-3 from rounding
alone, and a learning rate off by a third is still 38 times past it."""


def noise_floor(base: Config, args: list[str], out: Path, compare: _Comparison,
                tps: tuple[int, ...] = ()) -> Result | None:
    """The reference rerun on its one rank with each micro-batch's gradient summed in halves, and
    in quarters, and for each tensor-parallel degree in ``tps`` with its split matmuls' partial sums
    (``debug.tp_rounding``): the same computation, only rounded elsewhere, so how far each ends from
    the reference is this run's own bf16 noise -- what a layout's reordered sums also cause, however
    correct. Near a loss spike or a routing near-tie it grows many-fold within 20 steps, and from one
    reordering to the next by several times (one sample of it), so the floor is the largest of them,
    per measure. None (fixed bounds) when there is none: a micro-batch of one sequence, no TP."""
    rows = base.training.micro_batch or base.training.global_batch
    splits = [rows // parts for parts in (2, 4) if rows % parts == 0]
    tp_kinds = [f"TP's rounding over {tp}" for tp in tps]
    variants = [(f"micro-batches of {size}", f"{FLOOR_DIR}-{size}", [f"--training.micro_batch={size}"])
                for size in splits]
    variants += [(kind, f"{FLOOR_DIR}-tp{tp}", [f"--debug.tp_rounding={tp}"])
                 for kind, tp in zip(tp_kinds, tps, strict=True)]
    if not variants:
        print(f"noise floor: none (a micro-batch of {rows} sequences cannot be halved, no TP); fixed bounds",
              flush=True)
        return None
    kinds = ([f"micro-batches of {' and '.join(map(str, splits))}"] if splits else []) + tp_kinds
    name = f"noise floor (1 rank, {'; '.join(kinds)})"
    runs = []
    for what, dirname, extra in variants:
        print(f"noise floor: 1 rank, {what} ...", flush=True)
        run_dir = out / dirname
        err = _train([*args, f"--run.dir={run_dir}", *parse_layout("")[0], *extra], 1, out / f"{dirname}.log")
        if err:
            raise ConfigError(f"the noise-floor run failed: {err} (log: {out / dirname}.log)")
        runs.append(compare(name, 1, run_dir, curve=f"reference, {what}"))
    routing = None
    if runs[0].routing is not None:
        routing = {k: max(r.routing[k] for r in runs) for k in ("tokens", "differ", "max_gap")}
    return Result(name, 1, max(r.loss_abs for r in runs), max(r.loss_rel for r in runs),
                  max(r.param_rel for r in runs), True, routing=routing)


def floor_bounds(tol: Tolerance, floor: Result | None, param_cap: float = FLOOR_CAP) -> Tolerance:
    """``tol``, each bound raised to :data:`FLOOR_FACTOR` times ``floor``'s distance where that is
    more (the loss up to :data:`FLOOR_CAP` times ``tol``, the parameters up to ``param_cap`` times)."""
    if floor is None:
        return tol
    gap = floor.routing["max_gap"] if floor.routing else 0.0
    return Tolerance(loss_rel=min(max(tol.loss_rel, FLOOR_FACTOR * floor.loss_rel), FLOOR_CAP * tol.loss_rel),
                     param_rel=min(max(tol.param_rel, FLOOR_FACTOR * floor.param_rel),
                                   param_cap * tol.param_rel),
                     route_gap=max(tol.route_gap, FLOOR_FACTOR * gap))


def floor_notice(fixed: Tolerance, tol: Tolerance, floor: Result, precision: str = "bf16") -> str:
    """One line on the bounds: fixed, or which ones the noise floor raised and what that means."""
    raised = [f"{label} {getattr(fixed, key):g} -> {getattr(tol, key):.2g}"
              for key, label in (("loss_rel", "loss"), ("param_rel", "params"), ("route_gap", "routing gap"))
              if getattr(tol, key) > getattr(fixed, key)]
    if FLOOR_FACTOR * floor.loss_rel > tol.loss_rel or FLOOR_FACTOR * floor.param_rel > tol.param_rel:
        fix = "verify fewer --steps, or --training.mixed_precision=fp32" if precision == "bf16" else (
            "verify more --steps (Adam's first updates are the most sensitive), or compare with real ranks")
        return (f"notice: this run's own {precision} noise (the reference, only rounded elsewhere, ends loss "
                f"{floor.loss_rel:.1e} / params {floor.param_rel:.2g} of the update apart) reaches the "
                f"widest bounds verify allows ({'; '.join(raised)}: they still catch a learning rate "
                f"off by a third); a correct layout may fail them here: {fix}")
    if not raised:
        return (f"noise floor: within the fixed bounds (the reference rounded elsewhere ends "
                f"{floor.param_rel:.1e} of the update apart)")
    proof = ("--training.mixed_precision=fp32 (fixed bounds) is the proof" if precision == "bf16" else
             "the losses are still held to the fixed bound")
    return (f"notice: this run's own {precision} noise is above the fixed bounds, which are raised to "
            f"{FLOOR_FACTOR:g}x the noise floor ({'; '.join(raised)}): a layout error smaller than that "
            f"cannot be told from rounding here; {proof}")


def localize_layouts(common: list[str], seed: Path, layouts: list[tuple[str, list[str], int, bool]],
                     out: Path, precision: str,
                     simulated: Callable[[list[str], int, Path], None] | None = None) -> None:
    """Re-run the first step from ``seed`` on one rank and on each layout, capturing every module
    output and gradient (``debug.capture``), and print where each layout first departs.
    ``simulated(layout_args, world, into)``: each layout's step runs as simulated ranks, captured
    into ``into`` (the reference is still a real rank)."""
    one_step = ["--training.stop_after=1", "--debug.trace_step=1", "--compile.enabled=false",
                "--checkpoint.final=false", f"--checkpoint.path={seed}"]  # (after a layout's own keys)
    print(f"\nlocalizing: step 1 from the seed, every module output and gradient ({precision})", flush=True)
    ref = out / "capture" / "reference"
    out.mkdir(parents=True, exist_ok=True)
    err = _train([*common, *one_step, f"--run.dir={out / 'reference'}", f"--debug.capture={ref}",
                  *parse_layout("")[0]], 1, out / "reference.log")
    if err:
        raise ConfigError(f"the localizing reference run failed: {err} (log: {out / 'reference.log'})")
    for name, layout_args, world, failed in layouts:
        run_dir = out / run_dirname(name)
        captured = out / "capture" / run_dir.name
        if simulated is not None:
            simulated(layout_args, world, captured)
            err = ""
        else:
            err = _train([*common, *layout_args, *one_step, f"--run.dir={run_dir}",
                          f"--debug.capture={captured}"], world, out / f"{run_dir.name}.log")
        if err:
            print(f"{name}: its localizing run failed: {err}")
            continue
        found, worst = localize(ref, captured, precision, _residual_split(name))
        print(format_localized(name, found, worst, precision, failed))


def _residual_split(layout: str) -> str:
    """The mesh dims of ``layout`` that split the residual stream (batch, sequence, stage) and the
    experts."""
    what = {Mesh.DP_REPLICATE: "batch", Mesh.DP_SHARD: "batch", Mesh.CP: "sequence", Mesh.TP: "sequence",
            Mesh.PP: "stage", Mesh.EP: "experts, in routed feed-forwards"}
    degrees = dict(item.partition("=")[::2] for item in layout.split(",") if "=" in item)
    return ", ".join(f"{k} ({w})" for k, w in what.items() if int(degrees.get(k, "1") or 1) > 1)


def format_table(results: list[Result], tol: Tolerance, precision: str, floor: Result | None = None) -> str:
    """The verdict table: one row per layout, after the noise floor's row (bf16) that set the bounds."""
    moe = any(r.routing is not None for r in results)
    lines = [f"tolerances ({precision}): loss rel <= {tol.loss_rel:.2g}, params <= {tol.param_rel:.2g} "
             "of the update" + (f", own-routing score gap <= {tol.route_gap:.2g}" if moe else "")]
    if moe:
        lines.append("MoE: each layout routed every token to the reference's experts (replayed); "
                     "'own routing differs' counts the token-layer choices its own router would have "
                     "made otherwise, with the largest score gap among them")
    extra = (" own routing differs | max gap |", "---|---|") if moe else ("", "")
    lines += ["", "| layout | ranks | loss max abs diff | loss max rel diff | params diff / update |"
              f"{extra[0]} result |", f"|---|---|---|---|---|{extra[1]}---|"]
    for r in ([floor] if floor else []) + results:
        verdict = "PASS" if r.passed else ("FAIL: " + r.error if r.error else "FAIL")
        verdict = "(the bounds' noise floor)" if r is floor else verdict
        route = ""
        if moe:
            rt = r.routing or {"differ": 0, "tokens": 0, "max_gap": math.nan}
            route = f" {rt['differ']} of {rt['tokens']:,} | {rt['max_gap']:.1e} |"
        lines.append(f"| {r.layout} | {r.ranks} | {r.loss_abs:.2e} | {r.loss_rel:.2e} | {r.param_rel:.2e} |"
                     f"{route} {verdict} |")
    return "\n".join(lines)


def plot_overlay(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=110, sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    (ref_name, ref), *layouts = curves.items()
    steps = range(1, len(ref) + 1)
    ax.plot(steps, ref, lw=4, alpha=0.35, label=ref_name)
    for name, loss in layouts:
        ax.plot(steps, loss, lw=1.2, ls="--", label=name)
        # Curves that agree overlap above; the lower panel shows by how much they differ.
        dx.semilogy(steps, [max(abs(a - b) / abs(b), 1e-9) for a, b in zip(loss, ref, strict=True)],
                    lw=1.2, marker=".", label=name)
    ax.set_ylabel("loss")
    ax.set_title("shardwise verify: every layout over the 1-rank reference")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    dx.set_xlabel("step")
    dx.set_ylabel("|loss - ref| / ref")
    dx.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
