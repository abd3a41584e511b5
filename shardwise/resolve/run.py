"""Resolve a config for one world size, once: the layout (degrees checked against the world and
the model), the micro-batch split, the pipeline schedule's needs, the precision and the device --
as one frozen :class:`ResolvedRun` that everything downstream takes. Needs no process group, so
the planner checks thousands of layouts with it and preflight runs it before any rank starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import shardwise.runtime.distributed
import shardwise.runtime.machine
from shardwise.config.notice import notice
from shardwise.config.schema import Config, ConfigError, TrainingConfig
from shardwise.models import ModelArgs, model_args
from shardwise.parallel.dims import Mesh, ParallelDims
from shardwise.parallel.stages import PipelineShape, stages_per_rank
from shardwise.resolve.checks import last_step, resolve_config


@dataclass(frozen=True)
class ResolvedRun:
    """What a config means on ``dims.world_size`` ranks, derived once."""

    cfg: Config
    dims: ParallelDims
    model: ModelArgs
    micro_batch: int
    """Sequences per rank per forward/backward (the pipeline's micro-batch under PP)."""
    micro_batches: int
    """Micro-batches per rank per optimizer step (accumulation steps, or the pipeline's)."""
    loss_chunk: int
    """Tokens per chunk of the fused projection + loss; 0 = the plain loss."""
    precision: str
    """bf16 or fp32 (``auto`` resolved for the device)."""
    device_type: str
    """cpu or cuda."""
    compile: bool = False
    """torch.compile the blocks and the loss (compile.enabled, ``auto`` resolved: :func:`compile_run`)."""
    compile_reason: str = ""
    """Why ``auto`` chose as it did (said once, by preflight)."""
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The run's tokenizer, loaded once by preflight (None where no data is read: the planner)."""
    data_plan: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The run's data plan (:func:`shardwise.data.prepare.prepare_plan`: each source's files, prepared
    folder and settings), worked out once by preflight (None in the planner)."""

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.training.global_batch * self.cfg.training.seq_len

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def pipeline(self) -> PipelineShape:
        """The pipeline's degree and schedule (what its order of passes depends on)."""
        pc = self.cfg.parallel
        return PipelineShape(self.dims.pp, pc.pp_schedule, pc.pp_stages_per_rank)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds (1 without PP)."""
        return self.pipeline.stages_per_rank

    @property
    def local_seq(self) -> int:
        """Positions per sequence on one rank (S / cp)."""
        return self.cfg.training.seq_len // self.dims.cp

    def __str__(self) -> str:
        d, t = self.dims, self.cfg.training
        schedule = f" ({self.cfg.parallel.pp_schedule})" if d.pp > 1 else ""
        return (f"layout pp={d.pp}{schedule} dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} "
                f"cp={d.cp} tp={d.tp} ep={d.ep} (world {d.world_size}) | {t.global_batch}x{t.seq_len} "
                f"tokens/step, {self.micro_batches} micro-batch(es)/rank | {self.precision} on "
                f"{self.device_type}")


def resolve_model(cfg: Config) -> ModelArgs:
    """The model ``cfg`` describes (its ``[model]`` section, completed and checked by load_config).
    :func:`resolve_run` calls it once per run, and a run has it as ``run.model``; the planner calls it
    once to enumerate layouts."""
    return model_args(cfg.model)


def resolve_run(cfg: Config, world_size: int, detect_device: bool = True, model: ModelArgs | None = None
                ) -> ResolvedRun:
    """The layout checks -- degrees against the world, the model, the batch split and the pipeline
    schedule, and the features a layout cannot combine with -- and the run they resolve to. With
    pipeline parallel and no training.micro_batch, the micro-batch is chosen; it and what
    :func:`~shardwise.resolve.checks.resolve_config` resolves are recorded in the run's own copy of the
    config (``run.cfg``, which the saved config.toml is); ``cfg`` itself is left as it was.
    ``detect_device=False`` (the planner, which plans for other machines) takes run.device as written
    instead of finding this machine's. ``model``: the model, when the caller resolved it already."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    args = model or resolve_model(cfg)
    dims.check_model(args, cfg.training.seq_len)
    check_tp_rounding(cfg, dims, args)
    if args.n_experts and cfg.parallel.expert_load > args.n_experts / args.moe_top_k:
        raise ConfigError(f"parallel.expert_load={cfg.parallel.expert_load} exceeds n_experts/top_k="
                          f"{args.n_experts / args.moe_top_k:g} (an expert taking every token): lower it")
    chosen = pipeline_micro_batch(cfg, dims)
    # (the layout's refusals come first: resolving the precision may detect the device, loading torch)
    cfg = resolve_config(cfg)
    if chosen != cfg.training.micro_batch:
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batch=chosen))
    micro_batches = micro_batches_per_rank(cfg.training, dims.dp)
    check_pipeline(cfg, dims, micro_batches)
    if detect_device and args.balance_loss and args.moe_aux_scope == "batch" and micro_batches > 1:
        notice(f"model.moe_aux_scope=batch with {micro_batches} micro-batches per rank: each forward's "
               "balance loss is over its micro-batch on every rank, not the whole step's batch (one "
               "forward per rank makes it the whole batch: training.micro_batch=0, no pipeline)")
    device_type = shardwise.runtime.machine.device_type(cfg.run.device) if detect_device else cfg.run.device
    if detect_device and device_type == "cuda":
        shardwise.runtime.distributed.check_gpu_count(world_size)
    compiled, why = compile_run(cfg, dims, device_type, toolchain=detect_device)
    check_async_tp(cfg, dims, device_type, compiled)
    if cfg.parallel.one_rank == "plain" and world_size > 1 and detect_device:
        notice(f"parallel.one_rank=plain is for a run on one rank: these {world_size} ranks train with FSDP")
    micro_batch = micro_batch_size(cfg.training, dims.dp)
    return ResolvedRun(cfg, dims, args, micro_batch, micro_batches,
                       loss_chunk_tokens(cfg.training, args.vocab_size, dims.pp,
                                         max(dims.tp, cfg.debug.tp_rounding),  # (the loss TP would take)
                                         micro_batch * cfg.training.seq_len // dims.cp),
                       cfg.training.mixed_precision, device_type, compiled, why)


COMPILE_MIN_STEPS = 300
"""compile.enabled=auto compiles runs of at least this many steps: a cold compile costs seconds
before the first step and gains a few percent per step on the smallest preset (where compile pays
least), so it breaks even after a few hundred steps (BENCHMARKS.md, "time to first step"). A
bigger model saves more per step for the same compile (blocks share one graph), so it pays sooner."""


def check_tp_rounding(cfg: Config, dims: ParallelDims, args: ModelArgs) -> None:
    """debug.tp_rounding: on one rank without tensor parallel, for a model tp over that many ranks
    could split."""
    n = cfg.debug.tp_rounding
    if n < 0:
        raise ConfigError(f"debug.tp_rounding must be >= 0 (0 = off), got {n}")
    if n <= 1:
        return
    if dims.world_size > 1 or dims.tp > 1:
        raise ConfigError(f"debug.tp_rounding={n} emulates tensor parallel's rounding on one rank, not on "
                          f"{dims.world_size} ranks with tp={dims.tp}: run one rank, or set it to 0")
    try:
        dataclasses.replace(dims, tp=n).check_model(args, cfg.training.seq_len)
    except ConfigError as e:
        raise ConfigError(f"debug.tp_rounding={n}: {e}") from None


def check_async_tp(cfg: Config, dims: ParallelDims, device_type: str, compiled: bool) -> None:
    """parallel.async_tp: micro-pipelined TP is an inductor pass over symmetric memory (CUDA, NCCL)."""
    if not cfg.parallel.async_tp:
        return
    if dims.tp == 1:
        raise ConfigError("parallel.async_tp needs parallel.tp > 1 (it overlaps TP's collectives): "
                          "set parallel.tp or parallel.async_tp=false")
    if device_type == "cpu" or cfg.parallel.backend == "gloo":  # (the planner may pass "auto")
        raise ConfigError(f"parallel.async_tp needs CUDA GPUs and NCCL (symmetric memory); this run "
                          f"is {device_type}/{cfg.parallel.backend}: set parallel.async_tp=false")
    if not compiled:
        raise ConfigError("parallel.async_tp needs compile.enabled=true (the micro-pipelining is an "
                          "inductor pass over the compiled blocks): set it, or parallel.async_tp=false")


class _Degrees(Protocol):  # ParallelDims, or a planner Layout
    pp: int
    cp: int
    ep: int


def compile_run(cfg: Config, dims: _Degrees, device_type: str, toolchain: bool = True) -> tuple[bool, str]:
    """compile.enabled resolved for this run, and why (for ``auto``). ``true`` without the toolchain
    is refused in one line (inductor would fail at the first step); ``auto`` compiles long runs on
    the tested layouts. ``toolchain=False`` (the planner, planning other machines) skips that check."""
    want = cfg.compile.enabled
    if cfg.debug.trace and want is not False:  # (its hooks on every module would enter the graphs)
        if want is True:
            raise ConfigError("debug.trace hooks every module's output, eager only: set "
                              "compile.enabled=false (or auto) to trace")
        return False, "compile.enabled=auto: eager, debug.trace hooks every module"
    if cfg.lora.rank and want is not False:  # (a preset's compile.enabled=true adapts, said)
        return False, f"compile.enabled={str(want).lower()}: eager, LoRA runs eager so far"
    missing = shardwise.runtime.machine.compile_toolchain(device_type) if toolchain and want else None
    if want is True and missing:
        raise ConfigError(f"compile.enabled=true needs {missing} to build its {device_type} kernels: "
                          "install it, or set compile.enabled=false")
    if want != "auto":
        return bool(want), ""
    untested = [k for k in (Mesh.PP, Mesh.CP, Mesh.EP) if getattr(dims, k) > 1]
    steps = last_step(cfg)  # (the steps this run trains)
    if steps < COMPILE_MIN_STEPS:
        return False, (f"compile.enabled=auto: eager, {steps} steps do not amortize the compile "
                       f"(it compiles from {COMPILE_MIN_STEPS}); --compile.enabled true forces it")
    if untested:
        return False, (f"compile.enabled=auto: eager, compile with parallel.{untested[0]} > 1 is not "
                       "tested yet; --compile.enabled true forces it")
    if shardwise.runtime.machine.bf16_without_arithmetic(device_type, cfg.training.mixed_precision):
        # Compiled, the run skips shardwise.ops.cpu_bf16's fp32 paths: moe-debug's compiled bf16 step
        # took 45 s there, its eager one 2.7 s.
        return False, ("compile.enabled=auto: eager, compiled bf16 runs 16x slower than eager on a CPU "
                       "without bf16 arithmetic; --compile.enabled true forces it")
    if missing:
        return False, f"compile.enabled=auto: eager, torch.compile needs {missing}"
    return True, (f"compile.enabled=auto: compiling the blocks and the loss ({steps} steps amortize "
                  "the first step's compile); --compile.enabled false turns it off")


FUSED_LOSS_LOGITS = 2**25
"""Logits per chunk of the fused loss when training.loss_chunk = 0: 64 MiB in bf16, and the
chunk's matmuls stay large enough that narrower chunks would cost time (BENCHMARKS.md)."""

FUSED_LOSS_MAX_CHUNKS = 4
"""... but a micro-batch is cut into at most this many chunks: at a 128k vocabulary 2^25 logits are 261
tokens, and 32 chunks of a 4 x 2048 micro-batch slow a 1B step on a GPU by per-chunk launches and narrow
GEMMs (BENCHMARKS.md). Four chunks still hold a quarter of the logits the plain loss holds ..."""

FUSED_LOSS_MAX_LOGITS = 2**28
"""... and a chunk that floor makes holds at most this many logits (512 MiB in bf16): a large vocabulary
times a long micro-batch (Qwen3's 151,936 x 8 x 4,096) gets more chunks rather than gigabytes of
logits."""


def loss_chunk_tokens(t: TrainingConfig, vocab_size: int, pp: int, tp: int = 1, tokens: int = 0) -> int:
    """Tokens per chunk of the fused loss, or 0 for the plain loss (training.loss, training.loss_chunk);
    ``tokens``: those of one micro-batch on this rank (the chunks split them).
    ``auto`` is fused where the fused op computes its gradients in forward: not under pipeline
    parallel (refused there) nor tensor parallel (the vocab-parallel op recomputes the logits in
    backward, a memory saving rather than a speed-up: it runs when asked for)."""
    if pp > 1 and (t.loss == "fused" or t.loss_chunk):
        key = "training.loss_chunk" if t.loss_chunk else "training.loss=fused"
        raise ConfigError(f"{key} with parallel.pp > 1 is not available (the pipeline schedule "
                          "computes the loss on the last stage's logits): set training.loss=auto "
                          "and training.loss_chunk=0")
    if t.loss == "plain":
        if t.loss_chunk:
            raise ConfigError(f"training.loss_chunk={t.loss_chunk} is the fused loss's chunk: set "
                              "training.loss=fused (or auto), or training.loss_chunk=0")
        return 0
    if pp > 1 or (tp > 1 and t.loss == "auto" and not t.loss_chunk):
        return 0
    floor = min(-(-tokens // FUSED_LOSS_MAX_CHUNKS), FUSED_LOSS_MAX_LOGITS // vocab_size)
    return t.loss_chunk or max(1, FUSED_LOSS_LOGITS // vocab_size, floor)


def micro_batches_per_rank(t: TrainingConfig, dp: int) -> int:
    """Gradient-accumulation steps per optimizer step (the pipeline's micro-batches under PP)."""
    return t.global_batch // dp // micro_batch_size(t, dp)


def micro_batch_size(t: TrainingConfig, dp: int) -> int:
    if t.global_batch % dp:
        raise ConfigError(f"training.global_batch={t.global_batch} must be divisible by the "
                          f"data-parallel degree dp_replicate*dp_shard={dp}")
    per_rank = t.global_batch // dp
    mb = t.micro_batch or per_rank
    if per_rank % mb:
        raise ConfigError(f"training.micro_batch={mb} must divide the per-rank batch "
                          f"global_batch/dp={per_rank}")
    return mb


def pipeline_micro_batch(cfg: Config, dims: ParallelDims) -> int:
    """``training.micro_batch`` for this run: as set, or with pipeline parallel and none set (0,
    which means no accumulation), chosen for the user, with a notice: the largest one that gives
    the schedule at least ``4 * pp`` micro-batches (1F1B's bubble ``(pp-1)/(m+pp-1)`` then stays
    under 20%; fewer sequences per rank: micro-batches of one) among those the schedule accepts."""
    t = cfg.training
    if t.micro_batch or dims.pp == 1:
        return t.micro_batch
    per_rank = micro_batch_size(t, dims.dp)  # (checks that dp divides the batch)
    counts = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    want = min(4 * dims.pp, per_rank)
    for m in [m for m in counts if m >= want] + [m for m in reversed(counts) if m < want]:
        try:
            check_pipeline(cfg, dims, m)
        except ConfigError:
            continue
        bubble = (dims.pp - 1) / (m + dims.pp - 1)
        notice(f"parallel.pp={dims.pp}: training.micro_batch={per_rank // m} ({m} micro-batches per "
               f"step through the {cfg.parallel.pp_schedule} schedule; 1F1B bubble (pp-1)/(m+pp-1) = "
               f"{bubble:.0%}); set training.micro_batch to choose")
        return per_rank // m
    return 1  # none fits: the checks that follow name what the schedule needs


def check_pipeline(cfg: Config, dims: ParallelDims, n_microbatches: int) -> None:
    if dims.pp == 1:
        return
    pc = cfg.parallel
    v = stages_per_rank(pc.pp_schedule, pc.pp_stages_per_rank)
    if v < 1 or dims.pp * v > cfg.model.n_layers:
        raise ConfigError(f"parallel.pp_schedule={pc.pp_schedule} needs pp*stages_per_rank={dims.pp * v} "
                          f"stages of at least one block, but model.n_layers={cfg.model.n_layers}: lower "
                          "pp or parallel.pp_stages_per_rank")
    rounds = max(1, n_microbatches // dims.pp)
    if pc.pp_schedule == "dualpipev" and n_microbatches < 2 * dims.pp:
        raise ConfigError(f"parallel.pp_schedule=dualpipev needs at least 2*pp={2 * dims.pp} micro-batches "
                          f"per step (one per stage), got {n_microbatches}: lower training.micro_batch "
                          "or raise training.global_batch")
    if pc.pp_schedule == "interleaved1f1b" and n_microbatches % rounds:
        raise ConfigError(f"parallel.pp_schedule=interleaved1f1b needs the micro-batches per step "
                          f"({n_microbatches}) to be a multiple of max(1, micro-batches // pp)={rounds}: "
                          "change training.micro_batch")
    if cfg.parallel.pp_schedule == "1f1b" and n_microbatches < dims.pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least pp={dims.pp} micro-batches per step, "
                          f"got {n_microbatches}: lower training.micro_batch, raise training.global_batch "
                          "or use pp_schedule=gpipe")
