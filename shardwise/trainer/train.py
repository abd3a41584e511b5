"""The training loop: ``train()`` -> ``train_step()`` -> the loss of each micro-batch.

Loss normalization: every micro-batch's summed token loss is divided by the number of valid
(non-ignored) labels in the *whole global batch* -- all data-parallel ranks and all micro-batches --
and FSDP sums gradients across ranks. The gradient is then exactly that of the mean token loss of
the global batch, whatever the layout or accumulation split.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config.schema import ConfigError
from shardwise.data.dataset import Batch
from shardwise.launch import rundir
from shardwise.launch.resilience import exit_with_launcher, maybe_fail, plant_spike
from shardwise.models.moe import update_expert_bias
from shardwise.observe.memory import SavedActivations, state_bytes
from shardwise.ops.cpu_bf16 import use_fp32_gemms_for_bf16
from shardwise.optim.clip import clip_grad_norm_, folds_grad_scale
from shardwise.parallel.dims import Mesh
from shardwise.parallel.float8 import precompute_scales
from shardwise.parallel.pipeline import Pipe
from shardwise.resolve.checks import last_step
from shardwise.resolve.run import ResolvedRun
from shardwise.runtime.distributed import init_distributed
from shardwise.runtime.machine import bound_matmul_caches
from shardwise.trainer.loss import TokenLoss
from shardwise.trainer.session import Session, open_session


def train(run: ResolvedRun) -> None:
    """Train ``run`` (what :func:`preflight` resolved, once per process) on this process's rank: 1
    rank, or one of N under torchrun / --nproc."""
    started, cfg = time.perf_counter(), run.cfg
    exit_with_launcher()  # under torch's elastic agent a rank has a session of its own
    env = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.run.cpu_memory_cache)
    if run.dims.world_size != env.world_size:
        raise ConfigError(f"the run was resolved for {run.dims.world_size} ranks and started on "
                          f"{env.world_size}: resolve it for this world")
    if env.device.type == "cpu" and run.model.n_experts:  # before the first matrix product
        bound_matmul_caches()
    use_fp32_gemms_for_bf16(env.device.type, run.precision)
    # Host-side gloo groups for the checkpointer and the stop flag, made before the mesh: world-wide
    # groups must be created in the same order on every rank, which lazily built mesh groups break.
    ckpt_group, stop_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    run.dims.build_mesh(env.device.type, cfg.parallel.backend_override)
    set_determinism(cfg.debug.deterministic, cfg.training.seed)
    with rundir.hold(cfg, env.rank) as run_dir:
        s = open_session(run, env, run_dir, ckpt_group, stop_group, started)
        with s.profiler:
            loop(s)
        s.close()


def loop(s: Session) -> None:
    """Steps ``s.start + 1 .. training.steps`` (or ``training.stop_after``); each component decides
    when it acts."""
    cfg = s.run.cfg
    for step in range(s.start + 1, last_step(cfg) + 1):
        maybe_fail(cfg.debug, step, s.env.rank)
        batches = plant_spike(cfg.debug, step, s.loader.next_step(), s.run.model.vocab_size)
        with s.observe(step, batches):
            result = train_step(s.model, s.optimizer, s.scheduler, s.shard(batches), s.run, s.loss, s.pipe,
                                measure_memory=step == s.start + 1, inject_nan=step == cfg.debug.nan_step,
                                float8_scales=s.float8_scales, loss_limit=s.loss_limit(step))
        spike = s.check_loss(step, result)  # NaN: stop or skip; a spike: said, and always logged
        if result.memory is not None:
            s.report_first_step(result.memory)
        s.throughput.add(s.run.tokens_per_step, *s.step_flops(batches))
        last, stopping = step == last_step(cfg), s.stop.agreed()  # every rank stops alike
        evaluating, saving = s.evaluator.due(step, last), s.ckpt.due(step, last, stopping)
        if evaluating or spike or s.logger.due(step, last or stopping):
            s.logger.log(step, {**s.metrics(result), **spike, **(s.evaluator(s.model) if evaluating else {})})
        if saving:
            s.save(step, stopping)
        if evaluating or saving:
            s.throughput.reset()  # evaluation and saving are not training throughput
        s.logger.advance()
        s.profiler.step()
        if stopping:
            s.logger.message(f"received {s.stop.received}: stopped after step {step} with its "
                             "checkpoint saved; continue with --checkpoint.resume true")
            return


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as every rank sees it (tensors: reading them syncs)."""

    loss: torch.Tensor
    """Mean token loss of the global batch."""
    grad_norm: torch.Tensor
    lr: float
    """The learning rate the step used."""
    finite: torch.Tensor
    """False: the gradient norm was NaN/inf and the update was not applied (a bool tensor)."""
    applied: torch.Tensor
    """Whether the update was applied: finite, and the loss within the step's loss_limit (bool)."""
    expert_load: torch.Tensor | None = None
    """MoE: each MoE block's load (its busiest expert's routed slots over the mean), (L_moe,) in
    the order of ``expert_layers``."""
    expert_layers: tuple[int, ...] = ()
    """MoE: the block index of each entry of ``expert_load``."""
    memory: dict[str, int] | None = None
    """With measure_memory: this rank's bytes of params, grads, optimizer states, activations."""

    def scalars(self) -> dict[str, float]:
        out = {"loss": float(self.loss), "grad_norm": float(self.grad_norm), "lr": float(self.lr)}
        return out

    def expert_loads(self) -> dict[str, Any]:
        """MoE: ``expert_load`` (the worst block's) and ``expert_load_layers`` ({block: load});
        {} for a dense model."""
        if self.expert_load is None:
            return {}
        loads = self.expert_load.tolist()
        return {"expert_load": max(loads),
                "expert_load_layers": {str(i): v for i, v in zip(self.expert_layers, loads, strict=True)}}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, batches: list[Batch], run: ResolvedRun,
               loss: TokenLoss, pipe: Pipe | None = None, measure_memory: bool = False,
               inject_nan: bool = False, float8_scales: bool = False, loss_limit: float = math.inf
               ) -> StepResult:
    """One optimizer step over this rank's micro-batches (through the pipeline schedule under PP).
    ``inject_nan`` (fault injection) makes this step's loss NaN; ``float8_scales``: precompute the
    float8 weight scales FSDP gathers with, after the update (one all-reduce); ``loss_limit``: a
    global loss above it drops the update (training.spike=skip)."""
    dims = run.dims
    dp_cp = dims.submesh(Mesh.DP_CP).get_group()
    device = batches[0].inputs.device
    # (as_tensor: simulated ranks count theirs in a tensor, verify --ranks)
    n_valid = torch.as_tensor(sum(b.n_valid for b in batches), dtype=torch.int64, device=device)
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
                loss_sum += loss(model, batch, backward_over=n_valid)
    stages = dims.submesh(Mesh.PP).get_group() if dims.pp > 1 else None
    # (the clip's division is folded into a fused optimizer's kernel: one pass over the gradients)
    grad_norm = clip_grad_norm_(model.parameters(), run.cfg.training.max_grad_norm, stages, optimizer)
    lr = optimizer.param_groups[0]["lr"]
    dist.all_reduce(loss_sum, group=dp_cp)  # (every stage holds it under PP: every rank agrees)
    # The norm and the loss are reduced over every rank, so all agree on skipping an update.
    finite = torch.isfinite(grad_norm)
    applied = finite & (loss_sum / n_valid <= loss_limit) if loss_limit < math.inf else finite
    if folds_grad_scale(optimizer):  # its kernel skips the update itself: no host sync mid-step
        optimizer.found_inf = (~applied).float()
        optimizer.step()
    elif applied:  # (a host sync)
        optimizer.step()
    for key in ("grad_scale", "found_inf"):  # this step's only
        optimizer.__dict__.pop(key, None)
    scheduler.step()  # a skipped update still uses up its step of the LR schedule
    if float8_scales:  # next step's float8 weight scales, one all-reduce
        precompute_scales(model)
    memory = state_bytes(model, optimizer) if measure_memory else None  # before grads are freed
    optimizer.zero_grad(set_to_none=True)
    if memory is not None:
        memory = {**memory, "activations": max(t.bytes for t in saved)}
    return StepResult(loss_sum / n_valid, grad_norm, lr, finite, applied, expert_load(model, run, device),
                      moe_blocks(run), memory)


def moe_blocks(run: ResolvedRun) -> tuple[int, ...]:
    """The block indices of the model's MoE blocks (all pipeline stages)."""
    return tuple(i for i in range(run.model.n_layers) if run.model.n_experts and run.model.is_moe_layer(i))


def expert_load(model: nn.Module, run: ResolvedRun, device: torch.device) -> torch.Tensor | None:
    """MoE: update the routing biases from the step's token counts (all-reduced over every rank
    that routes different tokens); every MoE block's load, (L_moe,) in :func:`moe_blocks` order,
    gathered over the pipeline stages (each fills its own blocks)."""
    blocks = moe_blocks(run)
    if not blocks:
        return None
    dims = run.dims
    here = update_expert_bias(model, dims.submesh(Mesh.DP_CP_TP).get_group())
    if dims.pp == 1:
        return torch.stack([here[i] for i in blocks])
    loads = torch.zeros(len(blocks), device=device)
    for i, load in here.items():
        loads[blocks.index(i)] = load
    dist.all_reduce(loads, op=dist.ReduceOp.MAX, group=dims.submesh(Mesh.PP).get_group())
    return loads


def set_determinism(deterministic: bool, seed: int) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
