"""The training loop: ``train()`` -> ``train_step()`` -> ``forward_backward()``.

Loss normalization: every micro-batch's summed token loss is divided by the number of valid
(non-ignored) labels in the *whole global batch* -- all data-parallel ranks and all micro-batches --
and FSDP sums gradients across ranks. The gradient is then exactly that of the mean token loss of
the global batch, whatever the layout or accumulation split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardwise import checkpoint, rundir
from shardwise.config import Config, ParallelConfig
from shardwise.data.dataset import IGNORE_INDEX, Batch, Corpus, PackedLoader, check_vocab, open_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.device import DistEnv, init_distributed
from shardwise.models import ModelArgs, build_model, init_weights, model_args
from shardwise.models.moe import moe_layers, update_expert_bias
from shardwise.observe.comm import trace_step
from shardwise.observe.flops import batch_pairs, executed_flops, flops_per_token, num_params
from shardwise.observe.memory import (
    GiB,
    SavedActivations,
    current_memory_gib,
    peak_memory_gib,
    state_bytes,
    track_peak,
)
from shardwise.observe.metrics import MetricsLogger, Throughput, per_rank
from shardwise.observe.peak import peak_tflops
from shardwise.observe.plot import plot_loss
from shardwise.observe.profile import StepProfiler
from shardwise.observe.routing import RoutingTrace, routing_trace
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.clip import clip_grad_norm_
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.context import shard_sequences
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.float8 import precompute_scales
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline import (
    Pipe,
    attach_stage_views,
    rank_stages,
    split_stage,
)
from shardwise.parallel.tensor import full_value
from shardwise.preflight import (
    load_candidates,
    micro_batch_size,
    micro_batches_per_rank,
    no_good_checkpoint,
    preflight,
)
from shardwise.resilience import (
    NonFiniteError,
    StopRequest,
    exit_with_launcher,
    maybe_fail,
    nonfinite_message,
)


def train(cfg: Config, dims: ParallelDims | None = None) -> None:
    """Train ``cfg`` on this process's rank (1 rank, or one of N under torchrun / --nproc).
    ``dims``: the layout :func:`preflight` returned for this world (run here when not given)."""
    exit_with_launcher()  # under torch's elastic agent a rank has a session of its own
    env = init_distributed(cfg.run.device, cfg.parallel.backend)
    if dims is None or dims.world_size != env.world_size:
        dims = preflight(cfg, env.world_size)
    # Host-side gloo groups for the checkpointer and the stop flag, made before the mesh: world-wide
    # groups must be created in the same order on every rank, which lazily built mesh groups break.
    ckpt_group, stop_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    dims.build_mesh(env.device.type, cfg.parallel.backend_override)
    set_determinism(cfg.debug.deterministic, cfg.training.seed)
    with rundir.hold(cfg, env.rank) as run_dir:
        run(cfg, env, dims, run_dir, ckpt_group, stop_group)


def run(cfg: Config, env: DistEnv, dims: ParallelDims, run_dir: Path, ckpt_group: dist.ProcessGroup,
        stop_group: dist.ProcessGroup) -> None:
    """Build the rank's model, data, optimizer and checkpointer, then train ``cfg.training.steps``."""
    args = model_args(cfg.model)

    loader, corpus = build_data(cfg, dims, env.device, args.vocab_size)
    model = build_rank_model(cfg, dims, env.device)
    pipe = build_pipe(model, dims, cfg, env.device)
    for moe in moe_layers(model):  # the balance loss is a mean over the step's sequences
        moe.sequences_per_step = cfg.training.global_batch
    shard = batch_sharder(dims, cfg.parallel.cp_load_balance)
    # The plain loss (fp32 upcast, log-softmax, gather) compiles into fused kernels; loss-parallel
    # DTensor logits and the chunked loss stay eager.
    loss_fn = torch.compile(token_loss_sum) if cfg.compile.enabled else token_loss_sum
    optimizer = build_optimizer(model, cfg.optimizer, env.device.type)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    routing = build_routing_trace(cfg, dims, model, run_dir, env.rank)
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint, manifest_info(cfg, dims),
                                   ckpt_group)
    stop = StopRequest(stop_group)  # SIGTERM/SIGINT: finish the step, save, exit 0
    start = resume(cfg, run_dir, model, optimizer, scheduler, loader)
    if env.rank == 0:  # the run starts: its resolved config joins run.dir
        rundir.write_config(run_dir, cfg.to_toml())
    if cfg.checkpoint.save_initial and start == 0:
        ckpt.save(0, model, optimizer, scheduler, loader)

    throughput = Throughput(flops_per_token(args, cfg.training.seq_len),
                            shared_peak(env.device, cfg), env.world_size)
    if env.rank == 0:
        print(describe(cfg, dims, args, start), flush=True)
    logger = MetricsLogger(run_dir, cfg.metrics, cfg.training.steps, start, enabled=env.rank == 0,
                           run_config=dataclasses.asdict(cfg))
    if logger.notice:
        logger.message(logger.notice)
    tokens_per_step = cfg.training.global_batch * cfg.training.seq_len
    sharing = env.world_size // dims.dp  # ranks (pp x cp x tp) that split one data-parallel share
    ac = cfg.activation_checkpoint
    skipped = 0  # steps whose update was dropped for a non-finite gradient norm
    profiler = StepProfiler(cfg.profile, run_dir, env.rank, env.device, start + 1)
    with profiler:
        for step in range(start + 1, cfg.training.steps + 1):
            maybe_fail(cfg.debug, step, env.rank)
            batches = loader.next_step()
            # This data-parallel share's executed FLOPs, exact for its masks, per device of the share.
            flops = executed_flops(args, sum(b.inputs.numel() for b in batches),
                                   batch_pairs(batches, cfg.training.seq_len), ac.mode, ac.every,
                                   cfg.training.loss_chunk > 0).total / sharing
            first, traced = step == start + 1, step == max(cfg.debug.trace_step, start + 1)
            # (the peak tracker outside: its all-gather of every rank's peak is not the step's)
            with track_peak(cfg.debug.memory and traced, model, optimizer, run_dir / "memory_peak.json",
                            env.device), \
                    trace_step(cfg.debug.comm and traced, dims.mesh, dims.flat_meshes, run_dir / "comm.json",
                               env.rank, track_modules=dims.pp == 1), \
                    (routing.around_step(step, batches) if routing else contextlib.nullcontext()):
                result = train_step(model, optimizer, scheduler, shard(batches), dims,
                                    cfg.training.max_grad_norm, pipe, measure_memory=first,
                                    loss_fn=loss_fn, inject_nan=step == cfg.debug.nan_step)
            if not result.pop("finite"):  # the update was not applied
                if cfg.training.nonfinite == "stop":
                    ckpt.close()  # an async save in flight still commits: the last good state
                    latest = checkpoint.list_checkpoints(run_dir / "checkpoints")
                    raise NonFiniteError(nonfinite_message(step, float(result["grad_norm"]),
                                                           float(result["loss"]),
                                                           str(latest[-1][1]) if latest else None))
                skipped += 1
                logger.message(f"step {step}: non-finite gradient norm, update skipped ({skipped} so far)")
            if first:
                report_memory(result.pop("memory"), run_dir, env, logger)
            throughput.add(tokens_per_step, flops)
            last = step == cfg.training.steps
            stopping = stop.agreed()  # every rank stops after the same step
            do_eval = cfg.eval.interval > 0 and (step % cfg.eval.interval == 0 or last)
            do_save = (cfg.checkpoint.interval > 0 and step % cfg.checkpoint.interval == 0) or (
                cfg.checkpoint.final and last) or stopping
            if do_eval or step % cfg.metrics.log_interval == 0 or last or stopping:
                metrics = {k: float(v) for k, v in result.items()}  # float() of a tensor syncs
                metrics.update(**throughput.window(), memory_gib=peak_memory_gib(env.device),
                               memory_current_gib=current_memory_gib(env.device))
                metrics.update(per_rank({k: metrics[k] for k in ("step_time_s", "memory_gib")},
                                        env.device))
                if cfg.training.nonfinite == "skip":
                    metrics["skipped_steps"] = skipped
                metrics.update(loader.mix_metrics())
                if do_eval:
                    metrics.update(evaluate(model, corpus, cfg, dims, env.device, pipe, shard))
                logger.log(step, metrics)
            if do_save:
                path = ckpt.save(step, model, optimizer, scheduler, loader, block=stopping)
                how = "saved" if cfg.checkpoint.async_mode == "none" or stopping else "saving"
                logger.message(f"{how} checkpoint {path} (training blocked {ckpt.blocked_s:.2f} s)")
            if do_eval or do_save:
                throughput.reset()  # evaluation and saving are not training throughput
            logger.advance()
            profiler.step()
            if stopping:
                logger.message(f"received {stop.received}: stopped after step {step} with its "
                               "checkpoint saved; continue with --checkpoint.resume true")
                break
    ckpt.close()
    stop.restore()
    if routing:
        routing.close()
    finish(cfg, run_dir, logger, env.rank)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, batches: list[Batch],
               dims: ParallelDims, max_grad_norm: float, pipe: Pipe | None = None,
               measure_memory: bool = False,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
               inject_nan: bool = False) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches: global mean ``loss``, ``grad_norm``,
    ``lr`` used, ``finite`` (False: the gradient norm was NaN/inf and the update was not applied),
    for MoE models ``expert_load`` (busiest expert over the mean, worst layer), and with
    ``measure_memory`` this rank's ``memory`` breakdown in bytes. ``loss_fn`` sums the token losses
    of plain logits (default :func:`token_loss_sum`; its compiled form with compile.enabled).
    ``inject_nan`` (fault injection) makes this step's loss NaN.

    With pipeline parallel the schedule runs the micro-batches through the stages."""
    dp_cp = dims.submesh("dp_cp").get_group()
    device = batches[0].inputs.device
    n_valid = torch.tensor(sum(b.n_valid for b in batches), dtype=torch.int64, device=device)
    dist.all_reduce(n_valid, group=dp_cp)  # all-reduce over dp x cp: the global valid-token count
    n_valid = n_valid.clamp(min=1)
    if inject_nan:
        n_valid = n_valid * float("nan")
    # Activations: what autograd saves for backward -- per micro-batch (freed by its backward), or
    # everything a pipeline step holds in flight.
    saved = [SavedActivations() if measure_memory else contextlib.nullcontext()
             for _ in (batches if pipe is None else [None])]
    if pipe is not None:
        with saved[0]:
            loss_sum = pipe.forward_backward(batches, n_valid)
    else:
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for batch, tracker in zip(batches, saved, strict=True):
            with tracker:
                loss_sum += forward_backward(model, batch, n_valid, loss_fn or token_loss_sum)
    stages = dims.submesh("pp").get_group() if dims.pp > 1 else None
    grad_norm = clip_grad_norm_(model.parameters(), max_grad_norm, stages)
    lr = optimizer.param_groups[0]["lr"]
    # One host sync per step; the norm is already reduced over every rank, so all agree.
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    scheduler.step()  # a skipped update still uses up its step of the LR schedule
    if getattr(model, "float8_all_gather", False):  # next step's float8 weight scales, one all-reduce
        precompute_scales(model)
    memory = state_bytes(model, optimizer) if measure_memory else None  # before grads are freed
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum, group=dp_cp)
    result: dict[str, Any] = {"loss": loss_sum / n_valid, "grad_norm": grad_norm, "lr": lr,
                              "finite": finite}
    if memory is not None:
        result["memory"] = {**memory, "activations": max(t.bytes for t in saved)}
    if model.args.n_experts:
        load = update_expert_bias(model, dims.submesh("dp_cp_tp").get_group())
        if dims.pp > 1:  # the worst layer over all stages (a stage may hold no MoE block)
            load = load if load is not None else torch.zeros((), device=device)
            dist.all_reduce(load, op=dist.ReduceOp.MAX, group=stages)
        result["expert_load"] = load
    return result


def report_memory(memory: dict[str, int], run_dir: Path, env: DistEnv, logger: MetricsLogger) -> None:
    """Gather every rank's first-step breakdown; rank 0 prints it and writes memory_breakdown.json."""
    table = per_rank({k: v / GiB for k, v in memory.items()}, env.device)
    if env.rank == 0:
        (run_dir / "memory_breakdown.json").write_text(json.dumps(table, indent=1))
        rows = [f"{k:>12}: " + "  ".join(f"{v:.4f}" for v in table[f"{k}_per_rank"]) for k in memory]
        logger.message("memory at the first step, GiB per rank (params, grads, optimizer states; "
                       "activations = saved for backward):\n" + "\n".join(rows))


def forward_backward(model: nn.Module, batch: Batch, n_valid_global: torch.Tensor,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """Forward + backward of one micro-batch; returns its summed token loss (detached)."""
    if model.loss_chunk:  # fused chunked projection + loss: no logits
        loss_sum = model(batch.inputs, batch.doc_ids, labels=batch.labels, ignore_index=IGNORE_INDEX)
        (loss_sum / n_valid_global).backward()
        return loss_sum.detach()
    logits = model(batch.inputs, batch.doc_ids)  # (B, S, V); vocab-sharded DTensor under loss parallel
    with loss_context(logits):  # the backward of a loss-parallel cross-entropy needs it too
        fn = token_loss_sum if loss_fn is None or isinstance(logits, DTensor) else loss_fn
        loss_sum = fn(logits, batch.labels)
        (loss_sum / n_valid_global).backward()
    return full_value(loss_sum.detach())


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (fp32), ``IGNORE_INDEX`` labels excluded."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def loss_context(logits: torch.Tensor) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` for vocab-sharded DTensor logits (TP), else nothing."""
    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()



@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, cfg: Config, dims: ParallelDims,
             device: torch.device, pipe: Pipe | None = None,
             shard: Callable[[list[Batch]], list[Batch]] = list) -> dict[str, float]:
    """Mean token loss over the first ``eval.steps`` global batches of the held-out split (each
    source's held-out documents, mixed by the training weights)."""
    t = cfg.training
    val = [(s, w) for s, w in zip(corpus.val, corpus.val_weights, strict=True) if s.num_windows(t.seq_len)]
    n_batches = min(cfg.eval.steps, sum(s.num_windows(t.seq_len) for s, _ in val) // t.global_batch)
    if n_batches == 0:
        return {}
    loader = PackedLoader([s for s, _ in val], t.seq_len, t.global_batch, micro_batch_size(t, dims.dp),
                          dims.submesh("dp").get_local_rank(), dims.dp, seed=0,
                          document_mask=cfg.data.document_mask, device=device, shuffle=False,
                          weights=[w for _, w in val])
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, valid tokens)
    for _ in range(n_batches):
        batches = shard(loader.next_step())
        sums[1] += sum(b.n_valid for b in batches)
        if pipe is not None:
            sums[0] += pipe.loss_sum(batches)
            continue
        for b in batches:
            if model.loss_chunk:
                sums[0] += model(b.inputs, b.doc_ids, labels=b.labels, ignore_index=IGNORE_INDEX)
                continue
            logits = model(b.inputs, b.doc_ids)
            with loss_context(logits):
                sums[0] += full_value(token_loss_sum(logits, b.labels))
    dist.all_reduce(sums, group=dims.submesh("dp_cp").get_group())
    return {"val_loss": (sums[0] / sums[1].clamp(min=1)).item()}


# ---------------------------------------------------------------------------------------------
# Setup helpers


def build_rank_model(cfg: Config, dims: ParallelDims, device: torch.device | str) -> nn.Module:
    """This rank's model, ready to train: 1) on meta (this rank's pipeline stages) -> 2) parallelized
    -> 3) materialized on ``device`` -> 4) initialized from the run seed. ``dims`` has its mesh."""
    model = build_stage(model_args(cfg.model), dims, cfg.parallel)
    parallelize(model, dims, cfg)
    model.to_empty(device=device)
    init_weights(model, cfg.training.seed)
    model.loss_chunk = cfg.training.loss_chunk
    return model


def build_stage(args: ModelArgs, dims: ParallelDims, pc: ParallelConfig) -> nn.Module:
    """The model on meta, or with pipeline parallel only this rank's stages of it (one module)."""
    model = build_model(args)
    if dims.pp == 1:
        return model
    ids = rank_stages(dims.submesh("pp").get_local_rank(), dims.pp, pc.pp_schedule, pc.pp_stages_per_rank)
    part = split_stage(model, ids, dims.pp * len(ids))
    attach_stage_views(part, ids, dims.pp * len(ids))
    return part


def build_pipe(model: nn.Module, dims: ParallelDims, cfg: Config, device: torch.device) -> Pipe | None:
    if dims.pp == 1:
        return None
    n_micro = micro_batches_per_rank(cfg.training, dims.dp)
    # Loss parallel's backward must run inside its context, and the schedule runs the backward.
    ctx = loss_parallel if dims.tp > 1 and cfg.parallel.loss_parallel else contextlib.nullcontext
    return Pipe(model, dims.submesh("pp"), device, cfg.parallel.pp_schedule, n_micro, token_loss_sum, ctx,
                cfg.parallel.pp_stages_per_rank)


def batch_sharder(dims: ParallelDims, load_balance: bool) -> Callable[[list[Batch]], list[Batch]]:
    """Identity, or under context parallel: each micro-batch cut to this cp rank's positions."""
    if dims.cp == 1:
        return list
    mesh = dims.submesh("cp")

    def shard(batches: list[Batch]) -> list[Batch]:
        out = []
        for b in batches:
            inputs, labels = shard_sequences(mesh, [b.inputs, b.labels], load_balance)  # (B, S/cp)
            out.append(Batch(inputs, labels, None, int((labels != IGNORE_INDEX).sum()), b.first_row))
        return out
    return shard


def build_routing_trace(cfg: Config, dims: ParallelDims, model: nn.Module, run_dir: Path,
                        rank: int) -> RoutingTrace | None:
    """With debug.routing_record / debug.routing_replay: the trace on this rank's MoE layers."""
    d = cfg.debug
    if not (d.routing_record or d.routing_replay):
        return None
    cp_shard = None
    if dims.cp > 1:
        mesh, balance = dims.submesh("cp"), cfg.parallel.cp_load_balance
        cp_shard = lambda pos: shard_sequences(mesh, [pos], balance)[0]  # noqa: E731 -- (B, S/cp)
    tp = (dims.submesh("tp").get_local_rank(), dims.tp)
    return routing_trace(model, run_dir=run_dir, replay_from=d.routing_replay, seq_len=cfg.training.seq_len,
                         global_batch=cfg.training.global_batch, rank=rank, tp=tp, cp_shard=cp_shard)


def set_determinism(deterministic: bool, seed: int) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def build_data(cfg: Config, dims: ParallelDims, device: torch.device,
               vocab_size: int) -> tuple[PackedLoader, Corpus]:
    """Memory-map the prepared corpus (preparing what is not yet: under torchrun the first rank to
    reach a source's folder does it, the others wait on its lock) and build this rank's loader."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    corpus = open_corpus(cfg.data, tokenizer)
    check_vocab(corpus.max_token, vocab_size)
    t = cfg.training
    n_val = sum(s.num_windows(t.seq_len) for s in corpus.val)
    if cfg.eval.interval and n_val < t.global_batch and dist.get_rank() == 0:
        print(f"warning: the validation split has {n_val} sequences of {t.seq_len} tokens, fewer than "
              f"one global batch ({t.global_batch}): no validation loss (raise data.val_fraction)",
              flush=True)
    loader = PackedLoader(corpus.train, t.seq_len, t.global_batch, micro_batch_size(t, dims.dp),
                          dims.submesh("dp").get_local_rank(), dims.dp, t.seed,
                          cfg.data.document_mask, device, weights=corpus.weights, names=corpus.names)
    return loader, corpus


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
            print(f"checkpoint.resume: no checkpoint in '{run_dir / 'checkpoints'}' yet: starting at "
                  "step 1", flush=True)
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
                print(f"warning: checkpoint '{bad}' {why}: set aside as '{aside.name}'; resumed from the "
                      f"older {path.name}", file=sys.stderr, flush=True)
            print(f"resumed from {path} at step {step}", flush=True)
        return step
    raise no_good_checkpoint(run_dir, damaged)


def manifest_info(cfg: Config, dims: ParallelDims) -> dict[str, Any]:
    """What a checkpoint's manifest records about the run that wrote it."""
    layout = {k: getattr(dims, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    return {"layout": layout, "model": dataclasses.asdict(cfg.model)}


def shared_peak(device: torch.device, cfg: Config) -> float:
    """Rank 0 finds (or measures) the peak; every rank uses that figure."""
    box = [None]
    if dist.get_rank() == 0:
        box[0] = peak_tflops(device, cfg.training.mixed_precision, cfg.metrics.peak_tflops,
                             cfg.data.cache_dir)
    dist.broadcast_object_list(box, src=0)
    value, source = box[0]
    if dist.get_rank() == 0:
        print(f"MFU peak: {value:.3f} TFLOP/s per device ({source})", flush=True)
    return value


def describe(cfg: Config, dims: ParallelDims, args: ModelArgs, start: int) -> str:
    t = cfg.training
    accum = micro_batches_per_rank(t, dims.dp)
    schedule = f" ({cfg.parallel.pp_schedule})" if dims.pp > 1 else ""
    active = f", {num_params(args, active=True) / 1e6:.1f}M active" if args.n_experts else ""
    return (f"model {cfg.model.name}: {num_params(args) / 1e6:.1f}M params{active} | layout "
            f"pp={dims.pp}{schedule} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} "
            f"cp={dims.cp} tp={dims.tp} ep={dims.ep} (world {dims.world_size}) | "
            f"{t.global_batch}x{t.seq_len} tokens/step, {accum} micro-batch(es)/rank | "
            f"{t.mixed_precision} | steps {start + 1}..{t.steps}")


def finish(cfg: Config, run_dir: Path, logger: MetricsLogger, rank: int) -> None:
    logger.close()
    if rank == 0 and cfg.metrics.plot and (run_dir / "metrics.jsonl").stat().st_size:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png", f"{cfg.model.name} — {run_dir}")
        print(f"run directory: {run_dir} (config.toml, metrics.jsonl, tb/, loss.png, checkpoints/)")
    dist.barrier()
    dist.destroy_process_group()
