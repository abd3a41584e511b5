"""Everything one rank trains with, built once from the resolved run: data, model, pipeline, loss,
optimizer, schedule, checkpointer, evaluator, metrics, stop flag, profiler and traces -- each of
which decides its own timing, so the loop in train.py only calls them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from shardwise import checkpoint
from shardwise.checkpoint import hf as convert
from shardwise.checkpoint.peft import load_adapter
from shardwise.config.notice import say
from shardwise.config.outputs import RunRecord, target
from shardwise.config.schema import Config, ConfigError, model_label
from shardwise.data.dataset import (
    Batch,
    Corpus,
    PackedLoader,
    check_vocab,
    open_corpus,
    packing_notices,
    synthetic_corpus,
)
from shardwise.data.tokenizer import load_tokenizer
from shardwise.launch import rundir
from shardwise.launch.resilience import NonFiniteError, StopRequest, nonfinite_message
from shardwise.models.lora import flops_change_per_token
from shardwise.observe.capture import StepCapture
from shardwise.observe.comm import trace_step
from shardwise.observe.experts import CollapseWatch
from shardwise.observe.flops import (
    batch_pairs,
    executed_flops,
    flops_per_token,
    matmul_params,
    num_params,
    palm_flops,
)
from shardwise.observe.memory import GiB, current_memory_gib, peak_memory_gib, peak_reserved_gib, track_peak
from shardwise.observe.metrics import MetricsLogger, Throughput, per_rank
from shardwise.observe.peak import cpu_name, peak_tflops
from shardwise.observe.plot import plot_loss
from shardwise.observe.profile import StepProfiler
from shardwise.observe.routing import RoutingTrace, routing_trace
from shardwise.observe.spikes import SpikeWatch
from shardwise.observe.trace import RunTrace
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.context import shard_sequences
from shardwise.parallel.dims import DEGREES, Mesh
from shardwise.parallel.float8 import gathers_float8
from shardwise.parallel.pipeline import Pipe
from shardwise.resolve.checks import last_step
from shardwise.resolve.preflight import load_candidates, no_good_checkpoint
from shardwise.resolve.run import ResolvedRun
from shardwise.runtime.distributed import DistEnv
from shardwise.runtime.hub import local_model
from shardwise.trainer.build import batch_sharder, build_pipe, build_rank_model
from shardwise.trainer.evaluate import Evaluator
from shardwise.trainer.loss import TokenLoss

SPIKE_WINDOWS_NAMED = 16
"""A spike's notice names at most this many of its data windows (a large batch's rest are counted)."""


@dataclasses.dataclass
class Session:
    run: ResolvedRun
    env: DistEnv
    run_dir: Path
    model: nn.Module
    pipe: Pipe | None
    loss: TokenLoss
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: PackedLoader
    shard: Callable[[list[Batch]], list[Batch]]
    ckpt: checkpoint.Checkpointer
    evaluator: Evaluator
    logger: MetricsLogger
    throughput: Throughput
    stop: StopRequest
    profiler: StepProfiler
    routing: RoutingTrace | None
    trace: RunTrace | None
    capture: StepCapture | None
    """debug.capture: this rank's full module outputs and gradients of step debug.trace_step."""
    """debug.trace: this rank's signatures of every module output and gradient, per step."""
    float8_scales: bool
    """FSDP all-gathers float8 weights: their scales are precomputed after each optimizer step."""
    start: int
    """The step resumed after (0: a fresh run)."""
    started: float
    """perf_counter() when train() began (time to first step: start-up, and compile if on)."""
    spikes: SpikeWatch
    """The recent losses a step's loss is judged against (training.spike)."""
    collapse: CollapseWatch | None
    """MoE: each block's recent expert loads (a notice when its routing collapses)."""
    skipped: int = 0
    """Steps whose update was dropped for a non-finite gradient norm."""
    spikes_skipped: int = 0
    """Steps whose update was dropped as a loss spike (training.spike=skip)."""
    lora_flops: float = 0.0
    """LoRA: what the frozen base and the adapters change in a step's FLOPs per token (models/lora.py)."""

    def observe(self, step: int, batches: list[Batch]) -> contextlib.ExitStack:
        """Around one step: debug.memory / debug.comm at debug.trace_step, MoE routing traces,
        debug.trace's signatures."""
        cfg, env = self.run.cfg, self.env
        traced = step == max(cfg.debug.trace_step, self.start + 1)
        stack = contextlib.ExitStack()
        # (the peak tracker outside: its all-gather of every rank's peak is not the step's)
        stack.enter_context(track_peak(cfg.debug.memory and traced, self.model, self.optimizer,
                                       self.run_dir / "memory_peak.json", env.device))
        stack.enter_context(trace_step(cfg.debug.comm and traced, self.run.dims.mesh,
                                       self.run.dims.flat_meshes, self.run_dir / "comm.json", env.rank,
                                       track_modules=self.run.dims.pp == 1))
        if self.routing:
            stack.enter_context(self.routing.around_step(step, batches))
        if self.trace:
            stack.enter_context(self.trace.around_step(step))
        if self.capture and traced:
            stack.enter_context(self.capture.around_step(batches))
        return stack

    def step_flops(self, batches: list[Batch]) -> tuple[float | torch.Tensor, float | torch.Tensor | None]:
        """This data-parallel share's executed FLOPs, exact for its masks, per device of the share
        (the pp x cp x tp ranks that split it); and under document masks its PaLM-convention FLOPs
        (for MFU), which then count each document's length, not the window's."""
        run, ac = self.run, self.run.cfg.activation_checkpoint
        tokens, pairs = sum(b.inputs.numel() for b in batches), batch_pairs(batches, run.cfg.training.seq_len)
        lora = self.lora_flops * tokens
        flops = executed_flops(run.model, tokens, pairs, ac.mode, ac.every,
                               run.loss_chunk > 0 and run.dims.tp > 1).total + lora
        devices = self.env.world_size // run.dims.dp
        masked = any(b.doc_ids is not None for b in batches)
        return flops / devices, (palm_flops(run.model, tokens, pairs) + lora) / devices if masked else None

    def check_finite(self, step: int, result: Any) -> None:
        """A non-finite gradient norm (the update was not applied): stop with one line naming the
        last good checkpoint (training.nonfinite=stop), or count it and go on (skip)."""
        if result.finite:
            return
        if self.run.cfg.training.nonfinite == "stop":
            self.ckpt.close()  # an async save in flight still commits: the last good state
            latest = checkpoint.list_checkpoints(self.run_dir / "checkpoints")
            raise NonFiniteError(nonfinite_message(step, float(result.grad_norm), float(result.loss),
                                                   str(latest[-1][1]) if latest else None))
        self.skipped += 1
        self.logger.message(f"step {step}: non-finite gradient norm, update skipped ({self.skipped} so far)")

    def loss_limit(self, step: int) -> float:
        """The loss above which ``step``'s update is dropped (inf unless training.spike=skip)."""
        return self.spikes.limit(step) if self.run.cfg.training.spike == "skip" else math.inf

    def check_loss(self, step: int, result: Any) -> dict[str, float]:
        """The step's checks: a non-finite gradient norm (:meth:`check_finite`), then its loss against
        the recent ones -- a spike is said in a notice naming its data windows and marked in the
        step's metrics ({"spike": its ratio}); {} otherwise. Every rank holds the same global loss,
        so every rank agrees (the spike step is logged on all)."""
        self.check_finite(step, result)
        if self.collapse is not None:  # (a host sync, as the loss's below)
            if said := self.collapse.add(step, result.expert_loads()["expert_load_layers"]):
                self.logger.message("notice: " + said)
        spike = self.spikes.add(step, float(result.loss))
        if spike is None:
            return {}
        skipped = bool(result.finite) and not bool(result.applied)
        self.spikes_skipped += skipped
        windows = self.loader.last_windows()
        named = windows[:SPIKE_WINDOWS_NAMED] + ([f"... ({len(windows) - SPIKE_WINDOWS_NAMED} more)"]
                                                 if len(windows) > SPIKE_WINDOWS_NAMED else [])
        self.logger.message("notice: " + spike.describe(self.run.cfg.training.spike_window, named, skipped))
        return {"spike": spike.ratio}

    def metrics(self, result: Any) -> dict[str, Any]:
        """The step's metrics for the log (float() of a tensor syncs; per_rank gathers every rank's)."""
        device = self.env.device
        metrics = {**result.scalars(), **result.expert_loads(), **self.throughput.window(),
                   "memory_gib": peak_memory_gib(device), "memory_current_gib": current_memory_gib(device),
                   **peak_reserved_gib(device)}
        metrics.update(per_rank({k: metrics[k] for k in ("step_time_s", "memory_gib")}, device))
        if self.run.cfg.training.nonfinite == "skip":
            metrics["skipped_steps"] = self.skipped
        if self.run.cfg.training.spike == "skip":
            metrics["spikes_skipped"] = self.spikes_skipped
        return {**metrics, **self.loader.mix_metrics()}

    def save(self, step: int, stopping: bool) -> None:
        export = self.run.cfg.checkpoint.export_hf  # (it reads the committed checkpoint: wait for it)
        path = self.ckpt.save(step, self.model, self.optimizer, self.scheduler, self.loader,
                              block=stopping or export)
        how = "saved" if self.run.cfg.checkpoint.async_mode == "none" or stopping or export else "saving"
        self.logger.message(f"{how} checkpoint {path} (training blocked {self.ckpt.blocked_s:.2f} s)")
        if export and self.env.rank == 0:
            self.logger.message(export_hf_folder(path, self.run_dir, self.ckpt.retired_steps))

    def report_first_step(self, memory: dict[str, int]) -> None:
        """After the first step: the time to it (start-up, and the compile it paid); every rank's
        memory breakdown, which rank 0 prints and writes to memory_breakdown.json."""
        table = per_rank({k: v / GiB for k, v in memory.items()}, self.env.device)
        if self.env.rank == 0:
            compiled = "with the blocks' compile" if self.run.compile else "eager"
            self.logger.message(f"first step done {time.perf_counter() - self.started:.1f} s after start "
                                f"({compiled}; start-up, data, model and checkpoint load included)")
            (self.run_dir / "memory_breakdown.json").write_text(json.dumps(table, indent=1))
            rows = [f"{k:>12}: " + "  ".join(f"{v:.4f}" for v in table[f"{k}_per_rank"]) for k in memory]
            self.logger.message("memory at the first step, GiB per rank (params, grads, optimizer "
                                "states; activations = saved for backward):\n" + "\n".join(rows))

    def close(self) -> None:
        """Finish the save in flight, the traces and the logs; the plot; leave the process group."""
        cfg = self.run.cfg
        self.ckpt.close()
        self.stop.restore()
        if self.routing:
            self.routing.close()
        if self.trace:
            self.trace.close()
        if self.capture:
            self.capture.close()
        self.logger.close()
        if self.env.rank == 0 and cfg.metrics.plot and (self.run_dir / "metrics.jsonl").stat().st_size:
            plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png",
                      f"{model_label(cfg.model)} — {self.run_dir}")
            say(f"run directory: {self.run_dir} (config.toml, metrics.jsonl, tb/, loss.png, checkpoints/)")
        dist.barrier()
        dist.destroy_process_group()


def open_session(run: ResolvedRun, env: DistEnv, run_dir: Path, ckpt_group: dist.ProcessGroup,
                 stop_group: dist.ProcessGroup, started: float) -> Session:
    """Build this rank's parts (model: meta -> parallelize -> materialize -> init), then load the
    checkpoint it resumes from, if any, and start the logs."""
    cfg = run.cfg
    loader, corpus = build_data(run, env.device)
    model, pipe, shard, loss, optimizer, scheduler = build_step_parts(run, env.device)
    routing = build_routing_trace(run, model, run_dir, env.rank)
    trace = None
    if cfg.debug.trace:
        trace = RunTrace(Path(cfg.debug.trace), model, optimizer, env.rank,
                         {"world": env.world_size, "layout": str(run), "cpu": cpu_name(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__})
    capture = None
    if cfg.debug.capture:
        capture = StepCapture(Path(cfg.debug.capture), model, optimizer, run.dims, cfg.training.seq_len,
                              run.model.dim, cfg.parallel.cp_load_balance, env.rank)
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint, manifest_info(run), ckpt_group,
                                   record=RunRecord(run_dir) if env.rank == 0 else None)
    stop = StopRequest(stop_group)  # SIGTERM/SIGINT: finish the step, save, exit 0
    start = resume(cfg, run_dir, model, optimizer, scheduler, loader)
    if start == 0 and cfg.checkpoint.initial_hf:  # a fresh start from a Hugging Face folder
        convert.load_hf_weights(model, local_model(cfg.checkpoint.initial_hf, "checkpoint.initial_hf"),
                                run.model)
        if env.rank == 0:
            say(f"loaded the weights of {cfg.checkpoint.initial_hf}")
    if start == 0 and cfg.checkpoint.initial_adapter:  # the adapters too, on whichever base loaded
        n = load_adapter(model, Path(cfg.checkpoint.initial_adapter).expanduser(), run.model)
        if env.rank == 0:
            say(f"loaded {n} LoRA tensors of {cfg.checkpoint.initial_adapter}")
    if env.rank == 0:  # the run starts: its resolved config joins run.dir
        rundir.write_config(run_dir, cfg.to_toml())
    if cfg.checkpoint.save_initial and start == 0:
        ckpt.save(0, model, optimizer, scheduler, loader)
    lora = flops_change_per_token(model, matmul_params(run.model))
    throughput = Throughput(flops_per_token(run.model, cfg.training.seq_len) + lora,
                            shared_peak(env.device, cfg), env.world_size)
    if env.rank == 0:
        say(describe_run(run, start))
        for line in packing_notices(corpus, cfg.training.seq_len):  # chat data: whole conversations
            say(line)
    logger = MetricsLogger(run_dir, cfg.metrics, last_step(cfg), start, enabled=env.rank == 0,
                           run_config=dataclasses.asdict(cfg))
    if logger.notice:
        logger.message(logger.notice)
    return Session(run, env, run_dir, model, pipe, loss, optimizer, scheduler, loader, shard, ckpt,
                   Evaluator(run, corpus, loss, env.device, pipe, shard), logger, throughput, stop,
                   StepProfiler(cfg.profile, run_dir, env.rank, env.device, start + 1), routing, trace,
                   capture, gathers_float8(model, cfg.float8), start, started,
                   SpikeWatch(cfg.training.spike_factor, cfg.training.spike_window,
                              cfg.lr_scheduler.warmup_steps),
                   CollapseWatch(run.model.n_experts, run.model.moe_top_k) if run.model.n_experts else None,
                   lora_flops=lora)


def export_hf_folder(checkpoint_dir: Path, run_dir: Path, retired: list[int]) -> str:
    """checkpoint.export_hf (rank 0): ``checkpoint_dir`` as a Hugging Face folder ``run_dir/hf/<its
    name>``, staged then renamed; then the exports of the checkpoints this run retired
    (keep_latest_k) go with them -- only exports a run recorded, never one whose checkpoint a user
    removed. An existing folder is never replaced. Returns the line to log."""
    record, name = RunRecord(run_dir), checkpoint_dir.name
    out = run_dir / "hf" / name
    if out.exists() or out.is_symlink():
        return f"warning: {out} exists and is not replaced: no HF export of {name}"
    t0 = time.perf_counter()
    try:
        record.make_dir("hf")
        with target(out, "checkpoint.export_hf").staging() as staging:
            convert.export_hf(checkpoint_dir, staging, "bf16")
            record.note(f"hf/{name}", "tree")
    except OSError as e:  # a full disk, a read-only folder: the checkpoint itself is committed
        raise checkpoint.CheckpointError(
            f"could not export {name} as a Hugging Face folder in '{run_dir / 'hf'}': {e.strerror or e}: "
            f"free disk space or set checkpoint.export_hf=false (checkpoint {checkpoint_dir} is saved and "
            "intact; no half-written export is left)") from None
    ours = record.entries()
    for step in retired:
        old = run_dir / "hf" / f"step-{step}"
        if ours.get(f"hf/{old.name}") == "tree" and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)  # its checkpoint was retired (checkpoint.keep_latest_k)
    retired.clear()
    return f"exported {name} as a Hugging Face folder {out} ({time.perf_counter() - t0:.1f} s)"


class StepParts(NamedTuple):
    """What ``train_step`` takes from a session: this rank's model and pipeline, the context-parallel
    cut of its batches, the loss, the optimizer and its schedule."""

    model: nn.Module
    pipe: Pipe | None
    shard: Callable[[list[Batch]], list[Batch]]
    loss: TokenLoss
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_step_parts(run: ResolvedRun, device: torch.device | str) -> StepParts:
    """This rank's :class:`StepParts` (model: meta -> parallelize -> materialize -> init); the
    trainer's session and simulated ranks (``verify --ranks``) build them here."""
    cfg, device_type = run.cfg, torch.device(device).type
    model = build_rank_model(run, device)
    pipe = build_pipe(model, run, device)
    shard = batch_sharder(run.dims, cfg.parallel.cp_load_balance)
    loss = TokenLoss(run.loss_chunk, compiled=run.compile)
    optimizer = build_optimizer(model, cfg.optimizer, device_type, run.model.moe_router_lr_scale)
    return StepParts(model, pipe, shard, loss, optimizer,
                     build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps))


def build_data(run: ResolvedRun, device: torch.device) -> tuple[PackedLoader, Corpus]:
    """Memory-map the prepared corpus (preparing what is not yet: under torchrun the first rank to
    reach a source's folder does it, the others wait on its lock) and build this rank's loader."""
    corpus = open_run_corpus(run)
    return build_loader(run, corpus, run.dims.submesh(Mesh.DP).get_local_rank(), device), corpus


def open_run_corpus(run: ResolvedRun) -> Corpus:
    """The run's prepared corpus, memory-mapped (prepared first where it is not yet); with
    data.synthetic, random ids over the model's vocabulary."""
    cfg = run.cfg
    if cfg.data.synthetic:
        return synthetic_corpus(run.model.vocab_size, cfg.training.seed)
    corpus = open_corpus(cfg.data, run.tokenizer or load_tokenizer(cfg.data.tokenizer), plan=run.data_plan)
    check_vocab(corpus.max_token, run.model.vocab_size)
    return corpus


def build_loader(run: ResolvedRun, corpus: Corpus, dp_rank: int, device: torch.device | str) -> PackedLoader:
    """The loader of data-parallel rank ``dp_rank``'s micro-batches."""
    t = run.cfg.training
    return PackedLoader(corpus.train, t.seq_len, t.global_batch, run.micro_batch, dp_rank, run.dims.dp,
                        t.seed, run.cfg.data.document_mask, device, weights=corpus.weights,
                        names=corpus.names)


def build_routing_trace(run: ResolvedRun, model: nn.Module, run_dir: Path, rank: int) -> RoutingTrace | None:
    """With debug.routing_record / debug.routing_replay: the trace on this rank's MoE layers."""
    cfg, dims = run.cfg, run.dims
    d = cfg.debug
    if not (d.routing_record or d.routing_replay):
        return None
    cp_shard = None
    if dims.cp > 1:
        mesh, balance = dims.submesh(Mesh.CP), cfg.parallel.cp_load_balance
        cp_shard = lambda pos: shard_sequences(mesh, [pos], balance)[0]  # noqa: E731 -- (B, S/cp)
    tp = (dims.submesh(Mesh.TP).get_local_rank(), dims.tp)
    return routing_trace(model, run_dir=run_dir, replay_from=d.routing_replay, seq_len=cfg.training.seq_len,
                         global_batch=cfg.training.global_batch, rank=rank, tp=tp, cp_shard=cp_shard)


def resume(cfg: Config, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, loader: PackedLoader) -> int:
    """Load checkpoint.path, or when resuming (checkpoint.resume, or a restart after a failure) the
    newest checkpoint in run.dir that verifies; the damaged ones before it are set aside (renamed,
    never deleted) with a warning. None verifying is an error. Returns the step to continue after
    (0: start fresh)."""
    rank0 = dist.get_rank() == 0
    candidates, explicit = load_candidates(cfg, run_dir)
    if not candidates:
        if rank0 and cfg.checkpoint.resume:
            say(f"checkpoint.resume: no checkpoint in '{run_dir / 'checkpoints'}' yet: starting at "
                "step 1")
        return 0
    damaged: dict[Path, str] = {}
    for path in candidates:
        try:  # verification happens before anything is loaded, so falling back is safe
            step = checkpoint.load(path, model, optimizer, scheduler, loader,
                                   cfg.checkpoint.verify_checksums)
        except checkpoint.CheckpointError as e:
            if explicit:
                raise
            damaged[path] = e.reason
            continue
        if rank0:
            for bad, why in damaged.items():
                aside = checkpoint.set_aside(bad, "damaged")
                say(f"warning: checkpoint '{bad}' {why}: set aside as '{aside.name}'; resumed from the "
                    f"older {path.name}", err=True)
            say(f"resumed from {path} at step {step}")
        if step >= last_step(cfg):
            if explicit:  # a starting point past the end: nothing would train, say so
                raise ConfigError(f"checkpoint.path '{path}' is at step {step} and training.steps="
                                  f"{cfg.training.steps}: nothing is left to train: set training.steps above "
                                  f"{step}")
            if rank0:
                say(f"notice: the run is at step {step} of training.steps={cfg.training.steps}: nothing is "
                    "left to train (raise training.steps to go on)")
        return step
    raise no_good_checkpoint(run_dir, damaged)


def manifest_info(run: ResolvedRun) -> dict[str, Any]:
    """What a checkpoint's manifest records about the run that wrote it: the layout asked for, the
    mesh torch built for it (its dims' and views' sizes) and the model."""
    layout = {k: getattr(run.dims, k) for k in DEGREES}
    lora = {"lora": dataclasses.asdict(run.cfg.lora)} if run.cfg.lora.rank else {}  # (its tensors' shapes)
    return {"layout": layout, "mesh": run.dims.built_sizes(), "model": dataclasses.asdict(run.cfg.model),
            **lora}


def shared_peak(device: torch.device, cfg: Config) -> float:
    """Rank 0 finds (or measures) the peak; every rank uses that figure."""
    box = [None]
    if dist.get_rank() == 0:
        box[0] = peak_tflops(device, cfg.training.mixed_precision, cfg.metrics.peak_tflops,
                             cfg.data.cache_dir)
    dist.broadcast_object_list(box, src=0)
    value, source = box[0]
    if dist.get_rank() == 0:
        say(f"MFU peak: {value:.3f} TFLOP/s per device ({source})")
    return value


def describe_run(run: ResolvedRun, start: int) -> str:
    args = run.model
    active = f", {num_params(args, active=True) / 1e6:.1f}M active" if args.n_experts else ""
    lo = run.cfg.lora
    lora = f" | LoRA r={lo.rank} alpha={lo.alpha:g} on {lo.targets}, the rest frozen" if lo.rank else ""
    return (f"model {model_label(run.cfg.model)}: {num_params(args) / 1e6:.1f}M params{active}{lora} | {run} "
            f"| steps {start + 1}..{last_step(run.cfg)}")
