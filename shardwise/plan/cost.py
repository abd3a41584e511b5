"""Step time of a layout on a hardware profile: compute, exposed communication, pipeline bubble.

**Compute** of each rank, per micro-batch, from the work it executes:

- every GEMM with its shape (the matmul FLOPs of :func:`shardwise.observe.flops.executed_flops`,
  split per rank, recompute included) at the hardware's matmul rate -- on ``local``, the rate
  measured for that GEMM width and the rank's thread count;
- causal attention at the attention rate (measured per head width on ``local``);
- memory-bound work -- norms, RoPE, SwiGLU's elementwise half, residual adds, casts, the loss's
  softmax, FSDP's copy-in/out and the optimizer -- as bytes read and written over the memory
  bandwidth (backward moves about twice the forward's bytes); on ``local`` each term uses the
  bandwidth measured for its tensor size and the run's allocator: outputs over 16 MiB are fresh
  pages, faulted in afresh each step, unless the run keeps freed memory (run.cpu_memory_cache, the
  default), and FSDP's copies are not among the ops compile fuses;
- on ``local`` the host overhead measured per block and per step (Python, dispatcher, hooks); on
  GPUs it is assumed hidden behind the kernels.

**Communication**: :mod:`shardwise.plan.overlap` times each collective and what of FSDP's traffic
the compute hides.

**Pipeline bubble** (per-micro-batch stage times ``t_i``, the slowest ``t_max``): the first
micro-batch's forward and the last one's backward cross every stage but the slowest, ``sum(t_i) -
t_max`` for GPipe and 1F1B, that over ``v`` interleaved (Narayanan et al., 2021), and over 6 for the
V schedules (ZB-H1's ``T_F + T_B - T_W`` per V chunk with equal F, B, W passes; Qi et al., 2024).
On GPUs every stage is costed at the slowest's time, ``(pp - 1) * t_max``, an upper bound that
needs only the first and last stages (the search costs no others); local ranks sharing cores cost
every stage, and the last, which also runs the output head, is the slowest by far on small models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from shardwise.config.model_args import ModelArgs
from shardwise.config.schema import Config
from shardwise.observe.flops import ATTENTION_BACKWARD, MATMUL_BACKWARD, attention_pairs, attention_width
from shardwise.optim.adamw import fused_kernel
from shardwise.parallel.ac import recomputes_whole
from shardwise.parallel.dims import Mesh
from shardwise.plan.activations import Shape, attention_linears, expert_rows, shape_of
from shardwise.plan.comm import Collective, boundary_bytes, fsdp_reduce_bytes, step_collectives
from shardwise.plan.hardware import Hardware
from shardwise.plan.overlap import collective_time, fsdp_exposed_seconds, fsdp_hidden_seconds, per_mesh_dim
from shardwise.plan.states import BYTES, RankStates, planned_device
from shardwise.resolve.run import ResolvedRun

COMPILE_MEMORY_FACTOR = 0.5
"""torch.compile fuses chains of elementwise ops (norms, RoPE, SwiGLU, casts) into single kernels
that read inputs and write outputs once; the model assumes it halves their memory traffic."""


@dataclass(frozen=True)
class RankTime:
    pp_rank: int
    compute: dict[str, float]
    """Seconds per step: matmul, attention, memory-bound, optimizer, host."""
    comm: dict[str, float]
    """Seconds per step per mesh dim (all of it, hidden or not)."""
    exposed_comm: float
    flops: float
    """Executed FLOPs per step (matmul + attention)."""

    @property
    def busy(self) -> float:
        return sum(self.compute.values()) + self.exposed_comm


@dataclass(frozen=True)
class StepTime:
    ranks: tuple[RankTime, ...]
    bubble: float
    step: float
    tokens_per_s: float
    """Whole job."""
    extra: dict[str, float] = field(default_factory=dict)
    """``compute``: the step's compute seconds where it is not the slowest rank's own (local ranks
    sharing cores)."""


class Gemm(NamedTuple):
    """One GEMM of a block, for one micro-batch on one rank."""

    flops: float
    """Forward FLOPs."""
    in_width: int
    out_width: int
    float8: bool
    """A linear ``float8.enabled`` converts."""
    recomputed: bool
    """Runs again in backward (activation checkpointing)."""
    rows: int
    """Rows per call (a routed expert's share of the slots)."""


def block_gemms(s: Shape, cfg: Config, layer: int) -> list[Gemm]:
    """Each GEMM of one block for one micro-batch on this rank, in forward order. The widths and rows
    set a GEMM's efficiency on CPUs (a routed expert's call has its share of the slots: balanced
    routing, the rank's ``E / ep`` experts receiving as many slots as it sends); float8:
    the linear is one ``float8.enabled`` converts (attention, dense and shared-expert MLPs; not the
    router or the grouped experts; local dims multiples of 16 and at least ``float8.min_dim``);
    recomputed: runs again in backward -- under full checkpointing all but the down projections
    whose output only feeds the residual add (as ``executed_flops`` counts), under
    ``selective_half`` the 2nd, 4th, ... linear layer of those. The grouped experts run their
    rows padding included (:func:`~shardwise.plan.activations.expert_rows`)."""
    a = s.args
    t, tn, d = s.tokens, s.norm_tokens, a.dim
    mode = cfg.activation_checkpoint.mode

    def fp8(*dims: int) -> bool:
        return cfg.float8.enabled and all(x % 16 == 0 and x >= cfg.float8.min_dim for x in dims)
    attention = attention_linears(a, s.tp)
    attn8 = fp8(*(w for x in attention if x.split for w in (x.inp, x.out)))
    # (forward FLOPs, in, out, float8, full recomputes it, rows); the grouped experts are not
    # linear layers; latent attention's whole compressions are not float8's
    linears = [(2 * t * x.inp * x.out, x.inp, x.out, attn8 and x.split, True, t) for x in attention]
    grouped = []
    if a.is_moe_layer(layer):
        h, slots = a.moe_hidden_dim, expert_rows(s)
        per_expert = max(1, round(slots * s.ep / a.n_experts))
        linears.append((2 * tn * d * a.n_experts, d, a.n_experts, False, True, tn))
        grouped = [(2 * 2 * slots * d * h, d, h, False, True, per_expert),
                   (2 * slots * d * h, h, d, False, True, per_expert)]
        if a.n_shared_experts:
            hs = a.n_shared_experts * h
            up = (2 * tn * d * hs, d, hs, fp8(d, hs), True, tn)
            linears += [up, up, (2 * tn * d * hs, hs, d, fp8(d, hs), False, tn)]
    else:
        f = a.ffn_hidden_dim // s.tp
        linears += [(2 * t * d * f, d, f, fp8(d, f), True, t), (2 * t * d * f, d, f, fp8(d, f), True, t),
                    (2 * t * d * f, f, d, fp8(d, f), False, t)]
    if mode == "selective_half":
        return [Gemm(*g[:4], g[4] and i % 2 == 1, g[5]) for i, g in enumerate(linears)] + \
            [Gemm(*g[:4], False, g[5]) for g in grouped]
    full = _recomputed(cfg, layer)
    return [Gemm(*g[:4], g[4] and full, g[5]) for g in linears + grouped]


def _float8_cast_bytes(s: Shape, cfg: Config, layer: int, gemms: list[Gemm]) -> float:
    """Bytes of the per-tensor scaling casts of one block's float8 linears for one micro-batch:
    each linear's input and output gradient (amax pass + cast pass), in the compute dtype in and
    one byte out."""
    a = s.args
    t, d = s.tokens, a.dim
    n = 0.0
    converted = [(x.inp, x.out) for x, g in zip(attention_linears(a, s.tp), gemms, strict=False)
                 if x.split and g.float8]
    # attention: each float8 linear casts its input and its output's gradient (Llama: wq, wk, wv
    # read the input, wo the attention output)
    n += t * sum(i + o for i, o in converted)
    if not a.is_moe_layer(layer) and gemms[-1].float8:  # w1, w3 read the input, w2 the product
        f = a.ffn_hidden_dim // s.tp
        n += t * (2 * d + f) + t * (2 * f + d)
    return 2 * n * (2 * s.e + 1)


def _recomputed(cfg: Config, layer: int) -> bool:
    return recomputes_whole(layer, cfg.activation_checkpoint)


def _elementwise_bytes(s: Shape, cfg: Config, layer: int) -> list[tuple[float, int]]:
    """(bytes read + written, size of the tensors involved) of one block's memory-bound forward ops
    for one micro-batch: the size decides how fast a CPU allocator serves their outputs. On CPU
    ranks, the routed slots' copies into and out of the experts' zero-padded groups too."""
    a, e = s.args, s.e
    t, tn, d = s.tokens, s.norm_tokens, a.dim
    h = a.n_heads // s.tp
    qk = (h + 1) * a.qk_rope_head_dim if a.mla else (a.n_heads + a.n_kv_heads) * a.head_dim // s.tp
    out = [(2 * tn * d * (24 + 2 * e), 4 * tn * d),  # two RMSNorms in fp32 (upcast, square-mean,
           (t * qk * (16 + 2 * e), 4 * t * qk),  # scale, weight, cast); RoPE on q and k
           (2 * tn * d * 3 * e, e * tn * d)]  # residual adds
    if a.mla:  # the latents' norms; q and k assembled and padded, v padded (copies)
        latents = a.q_lora_rank + a.kv_lora_rank
        width = a.kernel_head_dim
        out += [(t * latents * (24 + 2 * e), 4 * t * latents), (3 * t * h * width * 2 * e, e * t * h * width)]
    if a.is_moe_layer(layer):
        slots = tn * a.moe_top_k
        padded = expert_rows(s)
        out += [(slots * d * 6 * e, e * slots * d),  # gather, weight, scatter of the routed tokens
                (padded * a.moe_hidden_dim * 5 * e, e * padded * a.moe_hidden_dim)]  # SwiGLU
        if s.cpu:  # the zeroed groups, the copy in, the copy out
            out.append(((padded + 4 * slots) * d * e, e * padded * d))
        if a.n_shared_experts:
            hs = a.n_shared_experts * a.moe_hidden_dim
            out.append((tn * hs * 5 * e, e * tn * hs))
    else:
        f = a.ffn_hidden_dim // s.tp
        out.append((t * f * 5 * e, e * t * f))  # SiLU and the product
    return out


@dataclass
class ComputeTally:
    """One rank's compute seconds and executed FLOPs, summed term by term. Float sums depend on
    their order, so the parts of :func:`rank_time` add their terms in one fixed order."""

    hw: Hardware
    ranks: int
    """Ranks sharing the machine (local CPU ranks share its cores and bandwidth; GPUs ignore it)."""
    cached: bool = True
    """Whether freed CPU memory is kept for reuse (run.cpu_memory_cache; GPUs ignore it)."""
    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    """Memory-bound work."""
    flops: float = 0.0

    def traffic(self, nbytes: float, tensor_bytes: float, elementwise: bool = True) -> float:
        """Seconds to read and write ``nbytes`` of memory-bound work on tensors of ``tensor_bytes``
        (``elementwise``: a step's eager ops, not large copies; :meth:`Hardware.memory_bw`)."""
        return nbytes / self.hw.memory_bw(self.ranks, tensor_bytes, self.cached, elementwise)

    def add(self, other: ComputeTally) -> None:
        """Add another tally's terms (a block costed once for all blocks of its kind)."""
        self.matmul += other.matmul
        self.attention += other.attention
        self.memory += other.memory
        self.flops += other.flops

    def seconds(self, fused: float = 1.0) -> float:
        """Compute seconds so far, the memory-bound ones times ``fused`` (compiled blocks)."""
        return self.matmul + self.attention + fused * self.memory

    def scale(self, micro_batches: int) -> None:
        """From one micro-batch to the step's ``micro_batches``."""
        self.matmul = micro_batches * self.matmul
        self.attention = micro_batches * self.attention
        self.memory = micro_batches * self.memory
        self.flops *= micro_batches


def rank_time(run: ResolvedRun, rank_states: RankStates, hw: Hardware,
              colls: list[Collective] | None = None) -> RankTime:
    """Compute and communication seconds of one step on the rank with states ``rank_states``
    (``colls``: its collectives, if already listed)."""
    cfg = run.cfg
    shape = shape_of(run)
    micro_batches = run.micro_batches
    tally = ComputeTally(hw, ranks=run.world, cached=cfg.run.cpu_memory_cache)
    # (fused elementwise kernels: about half the memory passes of eager; FSDP's copies, added
    # after, are not compiled)
    fused = COMPILE_MEMORY_FACTOR if run.compile else 1.0
    per_layer: dict[int, float] = {}  # one micro-batch's forward + backward of each block
    kinds: dict[tuple, ComputeTally] = {}  # blocks of one kind cost the same: costed once
    for layer in rank_states.layers:
        kind = (shape.args.is_moe_layer(layer), _recomputed(cfg, layer))
        if kind not in kinds:
            kinds[kind] = ComputeTally(hw, tally.ranks, tally.cached)
            block_compute(kinds[kind], run, shape, layer)
        tally.add(kinds[kind])
        per_layer[layer] = kinds[kind].seconds(fused)
    head = tally.seconds(fused)
    if rank_states.has_head:
        head_compute(tally, cfg, shape)
    head = tally.seconds(fused) - head
    tally.scale(micro_batches)
    tally.memory *= fused
    fsdp_copy_traffic(tally, run, rank_states, shape)
    compute = {"matmul": tally.matmul, "attention": tally.attention, "memory-bound": tally.memory,
               "optimizer": optimizer_seconds(cfg, rank_states, hw, run.world, planned_device(run)),
               "host": host_seconds(run, rank_states, hw, micro_batches, shape.args)
               + gpu_host_seconds(cfg, shape.args, hw, per_layer) * micro_batches}
    colls = step_collectives(run, rank_states) if colls is None else colls
    seconds, memo = [], {}  # (blocks issue many identical collectives)
    for c in colls:
        if (key := (c.group, c.kind, c.nbytes, c.calls)) not in memo:
            memo[key] = collective_time(c, run.dims.degrees, hw, rank_states.pp_rank)
        seconds.append(memo[key])
    comm = per_mesh_dim(colls, seconds)
    fsdp = sum(secs for c, secs in zip(colls, seconds, strict=True) if c.overlap == "fsdp")
    if hw.comm_overlap and fsdp and run.dims.pp == 1:
        forward = {i: t / (3 + _recomputed(cfg, i)) for i, t in per_layer.items()}
        backward = {i: t - forward[i] for i, t in per_layer.items()}
        shown = fsdp_exposed_seconds(run, rank_states, hw, shape, forward, backward, head)
    elif hw.comm_overlap and fsdp:
        shown = fsdp - fsdp_hidden_seconds(colls, seconds, hw, sum(compute.values()))
    else:
        shown = fsdp
    exposed = sum(comm.values()) - fsdp + min(fsdp, shown)
    return RankTime(rank_states.pp_rank, compute, comm, exposed, tally.flops)


def block_compute(tally: ComputeTally, run: ResolvedRun, shape: Shape, layer: int) -> None:
    """Add one block's forward and backward for one micro-batch: its GEMMs (float8 ones at the fp8
    rate, recomputed ones again under activation checkpointing), float8's scaling casts, causal
    attention (under context parallel, a ring's steps), and the memory-bound ops."""
    cfg = run.cfg
    args, dtype, hw = shape.args, run.precision, tally.hw
    recompute = _recomputed(cfg, layer)
    gemms = block_gemms(shape, cfg, layer)
    for forward_flops, in_width, out_width, float8, recomputed, rows in gemms:
        flops = forward_flops * (1 + MATMUL_BACKWARD + (1 if recomputed else 0))
        tally.flops += flops
        rate = hw.matmul_tflops("fp8" if float8 else dtype, in_width, out_width, tally.ranks, rows)
        tally.matmul += flops / (rate * 1e12)
    tally.memory += tally.traffic(_float8_cast_bytes(shape, cfg, layer, gemms), shape.tokens * args.dim)
    pairs = shape.mb * attention_pairs(cfg.training.seq_len) / run.dims.cp  # load-balanced over cp
    forward_flops = 2 * (args.n_heads // shape.tp) * attention_width(args, executed=True) * pairs
    flops = forward_flops * (1 + ATTENTION_BACKWARD + (1 if recompute else 0))
    tally.flops += flops
    # (per call, this rank's queries: S / cp, heads as wide as the kernel runs them. A ring makes
    # cp calls of equal pairs: the diagonal one causal, the cp - 1 others unmasked, which run
    # faster a FLOP on CPUs -- no masked tiles)
    cp = run.dims.cp
    causal = hw.attention_tflops(dtype, args.kernel_head_dim, tally.ranks, seq=shape.seq)
    ring = causal if cp == 1 else hw.attention_tflops(dtype, args.kernel_head_dim, tally.ranks, shape.seq,
                                                      causal=False)
    tally.attention += flops / cp * (1 / causal + (cp - 1) / ring) / 1e12
    passes = 3 + (1 if recompute or cfg.activation_checkpoint.mode.startswith("selective") else 0)
    tally.memory += sum(tally.traffic(passes * nbytes, tensor_bytes)
                        for nbytes, tensor_bytes in _elementwise_bytes(shape, cfg, layer))


def head_compute(tally: ComputeTally, cfg: Config, shape: Shape) -> None:
    """Add the output head's forward and backward for one micro-batch, and the loss's softmax."""
    args, tokens = shape.args, shape.tokens
    vocab = args.vocab_size // shape.tp
    forward_flops = 2 * tokens * args.dim * vocab
    # the vocab-parallel chunked loss keeps no logits: it computes them again in backward
    flops = forward_flops * (1 + MATMUL_BACKWARD + (1 if shape.loss_chunk and shape.tp > 1 else 0))
    tally.flops += flops
    rows = min(shape.loss_chunk, tokens) if shape.loss_chunk else tokens
    rate = tally.hw.matmul_tflops(cfg.training.mixed_precision, args.dim, vocab, tally.ranks, rows)
    tally.matmul += flops / (rate * 1e12)
    # upcast, log-softmax (two passes), its backward
    tally.memory += tally.traffic(3 * tokens * vocab * (shape.e + 16), 4 * tokens * vocab)


def fsdp_copy_traffic(tally: ComputeTally, run: ResolvedRun, rank_states: RankStates,
                      shape: Shape) -> None:
    """Add FSDP's memory traffic over the step: each gather's copy-out into the parameters; each
    reduction packs the gradients into one reduce-dtype buffer, divides it, and copies the result
    into the shards. Pipeline ranks gather and reduce once per step."""
    micro_batches = run.micro_batches
    reduce_bytes = fsdp_reduce_bytes(run, shape)
    reductions = 1 if run.dims.pp > 1 else micro_batches
    for unit in rank_states.units:
        gathers = 1 if run.dims.pp > 1 else micro_batches * (2 if unit.reshard else 1)
        nbytes = gathers * 2 * shape.e * unit.numel + reductions * (shape.e + 5 * reduce_bytes) * unit.numel
        tally.memory += tally.traffic(nbytes, reduce_bytes * unit.numel, elementwise=False)


def optimizer_seconds(cfg: Config, rank_states: RankStates, hw: Hardware, ranks: int,
                      device_type: str) -> float:
    """AdamW and gradient clipping over the rank's parameter shards, in place (memory-bound). torch's
    fused AdamW (:func:`~shardwise.optim.adamw.fused_kernel`) takes the clip's division: the norm reads
    the fp32 gradients (4 bytes per element), then one kernel reads parameter, gradient and moments and
    writes them all back, the gradient too (it stores the division): 36 bytes, costed at the hardware's
    memory rate. Other kernels: 16 + 4 x state bytes + 12."""
    state_bytes = BYTES[cfg.optimizer.state_dtype]
    numel = rank_states.params / 4  # fp32 shards
    per_element = 36 if fused_kernel(cfg.optimizer, device_type) else 4 * 4 + 4 * state_bytes + 12
    return numel * per_element / hw.memory_bw(ranks)


def host_seconds(run: ResolvedRun, rank_states: RankStates, hw: Hardware, micro_batches: int,
                 args: ModelArgs) -> float:
    """Host time of the step, as calibrate timed it on the local CPU per block (dense or MoE; more under
    TP) and per step; ranks beyond the cores share them. 0 on GPUs, where it is assumed hidden behind
    the kernels."""
    overhead_ms = hw.overhead_ms
    if not overhead_ms:
        return 0.0
    tp = overhead_ms.get("per_tp_block", 0.0) if run.dims.tp > 1 else 0.0
    moe_block = overhead_ms.get("per_moe_block", overhead_ms["per_block"])
    blocks = sum(moe_block if args.is_moe_layer(i) else overhead_ms["per_block"] for i in rank_states.layers)
    host = 1e-3 * ((blocks + tp * len(rank_states.layers)) * micro_batches + overhead_ms["per_step"])
    return host * max(1.0, run.world / hw.cores) / hw.sharing(run.world)


HOST_OPS_PER_BLOCK = {"dense": (102, 301), "moe_block": (164, 507),
                      "qk_dense": (124, 375), "qk_moe_block": (186, 581),
                      "latent_dense": (139, 412), "latent_moe_block": (213, 581)}
"""ATen ops one eager block dispatches (forward, forward + backward), counted with a dispatch
mode on the debug presets (qk_: with QK-norm, as Qwen3's), the latent ones on DeepSeek-V3's
(tests/unit/test_plan_gpu.py recounts them): about half launch a kernel, the rest are views and
bookkeeping, which cost host time all the same."""


def host_ops(args: ModelArgs, layer: int, recomputed: bool) -> int:
    """Host-side ops of one block's forward and backward for one micro-batch (a recomputed block
    runs its forward twice). Compiled blocks are costed alike: a compiled block's graph call, guards
    and autograd wrappers cost about what the eager ops they replace do (measured by
    bench/gpu_model.py; the figures are in bench/results/history.md)."""
    kind = "moe_block" if args.is_moe_layer(layer) else "dense"
    attention = "latent_" if args.mla else "qk_" if args.qk_norm else ""
    forward, both = HOST_OPS_PER_BLOCK[attention + kind]
    return both + (forward if recomputed else 0)


def gpu_host_seconds(cfg: Config, args: ModelArgs, hw: Hardware, per_layer: dict[int, float]) -> float:
    """Seconds per micro-batch a GPU waits on its host: each block's ops at ``host_us_per_op``
    each, beyond what the block's kernels take (the host runs ahead of the GPU while they are
    longer). 0 on local ranks (their host time is measured) and on profiles without the figure."""
    if hw.cores or not hw.host_us_per_op:
        return 0.0
    return sum(max(0.0, 1e-6 * hw.host_us_per_op * host_ops(args, layer, _recomputed(cfg, layer))
                   - seconds) for layer, seconds in per_layer.items())


def step_time(run: ResolvedRun, states: list[RankStates], hw: Hardware) -> StepTime:
    """The step time of the slowest pipeline rank plus the bubble, and the job's tokens/s. On local
    ranks that outnumber the cores, a pipeline's step is :func:`shared_cores_pipeline`'s."""
    cfg = run.cfg
    ranks = tuple(rank_time(run, rank_states, hw) for rank_states in states)
    busy = max(r.busy for r in ranks)
    p2p = pipeline_hop_seconds(run, hw)
    bubble = pipeline_bubble(run, busy, p2p)
    step = busy + bubble
    extra = {}
    if hw.cores and run.dims.pp > 1 and run.world > hw.cores and len(ranks) == run.dims.pp:
        extra["compute"], bubble = shared_cores_pipeline(run, ranks, hw, p2p)
        step = extra["compute"] + bubble + max(r.exposed_comm for r in ranks)
    tokens = cfg.training.global_batch * cfg.training.seq_len
    return StepTime(ranks, bubble, step, tokens / step, extra)


def shared_cores_pipeline(run: ResolvedRun, ranks: tuple[RankTime, ...],
                          hw: Hardware, p2p: float = 0.0) -> tuple[float, float]:
    """(compute, bubble) seconds of a pipeline step on local ranks sharing fewer cores. Each rank's
    compute is costed at its share of a core (all ranks busy at once), but a pipeline rank that
    waits in the bubble gives its core to the others, so the cores do the step's total work
    packed: the step is the larger of that total over the cores and the slowest stage's
    critical path (its work, at a full core, plus the schedule's bubble)."""
    share = min(1.0, hw.cores / run.world)
    alone = [share * sum(r.compute.values()) for r in ranks]  # a core to itself
    packed = (run.world // run.dims.pp) * sum(alone) / hw.cores
    critical = max(alone) + pipeline_bubble(run, alone, p2p)
    slowest = max(sum(r.compute.values()) for r in ranks)
    step = max(packed, critical)
    return min(slowest, step), max(0.0, step - slowest)


def pipeline_bubble(run: ResolvedRun, busy: float | list[float], p2p: float = 0.0) -> float:
    """Idle seconds of the pipeline schedule, from each pipeline rank's ``busy`` seconds per step
    (one figure: every rank alike): the other ranks' time for one micro-batch, beside the slowest's
    (the module docstring gives the fraction per schedule), and the transfers the fill and the drain
    wait for: one activation send at each of the ``pp * v - 1`` stage boundaries the first
    micro-batch crosses on its way down (``v`` stages per rank), one gradient send at each on the
    last one's way back -- ``p2p`` seconds the pair."""
    if run.dims.pp == 1:
        return 0.0
    stages = [busy] * run.dims.pp if isinstance(busy, float | int) else busy
    others = (sum(stages) - max(stages)) / run.micro_batches
    schedule = run.pipeline.schedule
    fraction = (1.0 if schedule in ("gpipe", "1f1b") else
                1.0 / run.stages_per_rank if schedule == "interleaved1f1b" else 1.0 / 6)
    waits = (run.dims.pp * run.stages_per_rank - 1) * p2p
    return others * fraction + waits


def pipeline_hop_seconds(run: ResolvedRun, hw: Hardware) -> float:
    """Seconds of one stage boundary's activation send and gradient send for one micro-batch
    (0 without pipeline parallel)."""
    if run.dims.pp == 1:
        return 0.0
    nbytes = boundary_bytes(run, shape_of(run))
    send = Collective(Mesh.PP, "send", nbytes, 1, "forward", "pipeline")
    return 2 * collective_time(send, run.dims.degrees, hw)
