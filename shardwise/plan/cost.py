"""Step time of a layout on a hardware profile: compute, exposed communication, pipeline bubble.

**Compute** of each rank, per micro-batch, from the work it executes:

- every GEMM with its shape (the matmul FLOPs of :func:`shardwise.observe.flops.executed_flops`,
  split per rank, recompute included) at the hardware's matmul rate -- on ``local``, the rate
  measured for that GEMM width and the rank's thread count;
- causal attention at the attention rate (measured per head width on ``local``);
- memory-bound work -- norms, RoPE, SwiGLU's elementwise half, residual adds, casts, the loss's
  softmax, FSDP's copy-in/out and the optimizer -- as bytes read and written over the memory
  bandwidth (backward moves about twice the forward's bytes); on ``local`` the bandwidth measured
  for outputs above the allocator's large-allocation threshold is far lower (each such output is
  page-faulted in afresh), and each term uses the one its tensor size falls under;
- on ``local`` the host overhead measured per block and per step (Python, dispatcher, hooks); on
  GPUs it is assumed hidden behind the kernels.

**Communication**: each collective of :func:`shardwise.plan.comm.step_collectives` costs
``latency * hops + bytes * factor / bandwidth`` (ring algorithms: ``(n-1)/n`` of the buffer for
all-gather, reduce-scatter and all-to-all, twice that for all-reduce), with intra- or inter-node
bandwidth by whether the group's ranks fit in one node. With ``comm_overlap`` (GPUs) FSDP's
collectives hide behind compute except the first all-gather and the last reduce-scatter, or by
what exceeds the compute; tensor, context, expert and pipeline traffic is on the critical path.
On the CPU (gloo) nothing overlaps.

**Pipeline bubble** (slowest stage's per-micro-batch time ``t``): ``(pp - 1) * t`` for GPipe and
1F1B, ``(pp - 1) * t / v`` interleaved (Narayanan et al., 2021), ``(pp - 1) * t / 6`` for the V
schedules (ZB-H1's ``T_F + T_B - T_W`` per V chunk with equal F, B, W passes; Qi et al., 2024).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.config import Config
from shardwise.observe.flops import ATTENTION_BACKWARD, MATMUL_BACKWARD, attention_pairs
from shardwise.plan.comm import Collective, group_members, step_collectives
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import Layout
from shardwise.plan.memory import Shape, shape_of
from shardwise.plan.states import BYTES, RankStates

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


def _gemms(s: Shape, cfg: Config, layer: int) -> list[tuple[float, int, int, bool, bool]]:
    """(forward FLOPs, in width, out width, float8, recomputed) of each GEMM of one block for one
    micro-batch on this rank. The widths set a GEMM's efficiency on CPUs; float8: the linear is one
    ``float8.enabled`` converts (attention, dense and shared-expert MLPs; not the router or the
    grouped experts; local dims multiples of 16 and at least ``float8.min_dim``); recomputed: full
    checkpointing runs it again in backward (all but the down projections whose output only feeds
    the residual add, as ``executed_flops`` counts)."""
    a = s.args
    t, tn, d = s.tokens, s.norm_tokens, a.dim
    q, kv = a.n_heads * a.head_dim // s.tp, a.n_kv_heads * a.head_dim // s.tp

    def fp8(*dims: int) -> bool:
        return cfg.float8.enabled and all(x % 16 == 0 and x >= cfg.float8.min_dim for x in dims)
    attn8 = fp8(d, q, kv)
    out = [(2 * t * d * q, d, q, attn8, True), (2 * 2 * t * d * kv, d, kv, attn8, True),
           (2 * t * q * d, q, d, attn8, True)]
    if a.is_moe_layer(layer):
        h, slots = a.moe_hidden_dim, tn * a.moe_top_k
        out += [(2 * tn * d * a.n_experts, d, a.n_experts, False, True),
                (2 * 2 * slots * d * h, d, h, False, True), (2 * slots * d * h, h, d, False, True)]
        if a.n_shared_experts:
            hs = a.n_shared_experts * h
            out += [(2 * 2 * tn * d * hs, d, hs, fp8(d, hs), True),
                    (2 * tn * d * hs, hs, d, fp8(d, hs), False)]
    else:
        f = a.ffn_hidden_dim // s.tp
        out += [(2 * 2 * t * d * f, d, f, fp8(d, f), True), (2 * t * d * f, f, d, fp8(d, f), False)]
    return out


def _float8_cast_bytes(s: Shape, cfg: Config, layer: int, gemms: list) -> float:
    """Bytes of the per-tensor scaling casts of one block's float8 linears for one micro-batch:
    each linear's input and output gradient (amax pass + cast pass), in the compute dtype in and
    one byte out."""
    a = s.args
    t, d = s.tokens, a.dim
    q, kv = a.n_heads * a.head_dim // s.tp, a.n_kv_heads * a.head_dim // s.tp
    n = 0.0
    if gemms[0][3]:  # attention: wq, wk, wv read the input, wo the attention output
        n += t * (3 * d + q) + t * (q + 2 * kv + d)
    if not a.is_moe_layer(layer) and gemms[-1][3]:  # w1, w3 read the input, w2 the product
        f = a.ffn_hidden_dim // s.tp
        n += t * (2 * d + f) + t * (2 * f + d)
    return 2 * n * (2 * s.e + 1)


def _recomputed(cfg: Config, layer: int) -> bool:
    ac = cfg.activation_checkpoint
    return ac.mode == "full" or (ac.mode == "layer" and layer % ac.every == 0)


def _elementwise_bytes(s: Shape, cfg: Config, layer: int) -> list[tuple[float, int]]:
    """(bytes read + written, size of the tensors involved) of one block's memory-bound forward ops
    for one micro-batch: the size decides how fast a CPU allocator serves their outputs."""
    a, e = s.args, s.e
    t, tn, d = s.tokens, s.norm_tokens, a.dim
    qk = (a.n_heads + a.n_kv_heads) * a.head_dim // s.tp
    out = [(2 * tn * d * (24 + 2 * e), 4 * tn * d),  # two RMSNorms in fp32 (upcast, square-mean,
           (t * qk * (16 + 2 * e), 4 * t * qk),  # scale, weight, cast); RoPE on q and k
           (2 * tn * d * 3 * e, e * tn * d)]  # residual adds
    if a.is_moe_layer(layer):
        slots = tn * a.moe_top_k
        out += [(slots * d * 6 * e, e * slots * d),  # gather, weight, scatter of the routed tokens
                (slots * a.moe_hidden_dim * 5 * e, e * slots * a.moe_hidden_dim)]  # SwiGLU
        if a.n_shared_experts:
            hs = a.n_shared_experts * a.moe_hidden_dim
            out.append((tn * hs * 5 * e, e * tn * hs))
    else:
        f = a.ffn_hidden_dim // s.tp
        out.append((t * f * 5 * e, e * t * f))  # SiLU and the product
    return out


def rank_time(cfg: Config, layout: Layout, st: RankStates, hw: Hardware,
              colls: list[Collective] | None = None) -> RankTime:
    """Compute and communication seconds of one step on the rank with states ``st``."""
    s = shape_of(cfg, layout)
    a, dtype = s.args, cfg.training.mixed_precision
    m = layout.micro_batches(cfg.training.global_batch)
    ranks_here = layout.world  # local ranks share the machine; GPUs ignore it
    mm = attn = mem = 0.0  # seconds
    flops = 0.0

    def traffic(nbytes: float, tensor: float) -> float:
        return nbytes / hw.memory_bw(ranks_here, tensor)
    pairs = s.mb * attention_pairs(cfg.training.seq_len) / layout.cp  # load-balanced over cp
    for i in st.layers:
        again = _recomputed(cfg, i)
        for fwd, k, n, fp8, recomputed in _gemms(s, cfg, i):
            work = fwd * (1 + MATMUL_BACKWARD + (1 if again and recomputed else 0))
            flops += work
            mm += work / (hw.matmul_tflops("fp8" if fp8 else dtype, k, n, ranks_here) * 1e12)
        mem += traffic(_float8_cast_bytes(s, cfg, i, _gemms(s, cfg, i)), s.tokens * a.dim)
        fwd = 4 * (a.n_heads // s.tp) * a.head_dim * pairs
        work = fwd * (1 + ATTENTION_BACKWARD + (1 if again else 0))
        flops += work
        attn += work / (hw.attention_tflops(dtype, a.head_dim, ranks_here) * 1e12)
        passes = 3 + (1 if again or cfg.activation_checkpoint.mode == "selective" else 0)
        mem += sum(traffic(passes * n, size) for n, size in _elementwise_bytes(s, cfg, i))
    vocab = a.vocab_size // s.tp
    if st.has_head:
        fwd = 2 * s.tokens * a.dim * vocab
        work = fwd * (1 + MATMUL_BACKWARD + (1 if cfg.training.loss_chunk else 0))
        flops += work
        mm += work / (hw.matmul_tflops(dtype, a.dim, vocab, ranks_here) * 1e12)
        # upcast, log-softmax (two passes), its backward
        mem += traffic(3 * s.tokens * vocab * (s.e + 16), 4 * s.tokens * vocab)
    mm, attn, mem = m * mm, m * attn, m * mem
    flops *= m
    e = s.e
    red = BYTES[cfg.parallel.fsdp_reduce_dtype] if e == 2 else 4
    reductions = 1 if layout.pp > 1 else m
    for u in st.units:
        # FSDP: each gather's copy-out into the parameters; each reduction packs the gradients
        # into one reduce-dtype buffer, divides it, and copies the result into the shards
        gathers = 1 if layout.pp > 1 else m * (2 if u.reshard else 1)
        mem += traffic(gathers * 2 * e * u.numel + reductions * (e + 5 * red) * u.numel, red * u.numel)
    state_b = BYTES[cfg.optimizer.state_dtype]
    numel = st.params / 4
    optimizer = numel * (4 * 4 + 4 * state_b + 12) / hw.memory_bw(ranks_here)  # AdamW + clipping, in place
    host = 0.0
    if hw.overhead_ms:  # host time (local CPU): per block and step, more per block under TP;
        # ranks beyond the cores share them
        per_block = hw.overhead_ms["per_block"] + (hw.overhead_ms.get("per_tp_block", 0.0) if s.tp > 1 else 0)
        host = 1e-3 * (per_block * len(st.layers) * m + hw.overhead_ms["per_step"])
        host *= max(1.0, ranks_here / hw.cores)
    if cfg.compile.enabled:  # fused elementwise kernels: about half the memory passes of eager
        mem *= COMPILE_MEMORY_FACTOR
    compute = {"matmul": mm, "attention": attn, "memory-bound": mem,
               "optimizer": optimizer, "host": host}
    colls = step_collectives(cfg, layout, st) if colls is None else colls
    times = [collective_time(c, layout, hw, st.pp_rank) for c in colls]
    comm: dict[str, float] = {}
    for c, t in zip(colls, times, strict=True):
        comm[c.group] = comm.get(c.group, 0.0) + t
    exposed = sum(comm.values())
    fsdp = [(c, t) for c, t in zip(colls, times, strict=True) if c.overlap == "fsdp"]
    fsdp_t = sum(t for _, t in fsdp)
    if hw.comm_overlap and fsdp_t:
        # FSDP prefetches the next unit's gather and reduces the last unit's gradient while other
        # blocks compute: exposed are the step's first gather and last reduction, or whatever of
        # the traffic the compute is too short to cover.
        edges = (max((t / c.calls for c, t in fsdp if c.kind == "all_gather"), default=0.0)
                 + max((t / c.calls for c, t in fsdp if c.kind != "all_gather"), default=0.0))
        exposed -= fsdp_t - max(min(edges, fsdp_t), fsdp_t - sum(compute.values()))
    return RankTime(st.pp_rank, compute, comm, exposed, flops)


def collective_time(c: Collective, layout: Layout, hw: Hardware, pp_rank: int = 0) -> float:
    """Seconds of all calls of ``c`` (ring algorithms, alpha-beta)."""
    members = group_members(layout, c.group, pp_rank)
    n = len(members)
    if n <= 1:
        return 0.0
    span = max(members) - min(members) + 1
    if c.kind in ("send", "recv"):
        span = layout.world // layout.pp + 1  # neighbouring stages are a stage's width apart
    bw, lat = hw.link(span)
    if c.kind == "all_reduce":
        factor, hops = 2 * (n - 1) / n, 2 * (n - 1)
    elif c.kind in ("send", "recv"):
        factor, hops = 1.0, 1
    else:
        factor, hops = (n - 1) / n, n - 1
    return c.calls * (hops * lat + factor * c.nbytes / bw)


def step_time(cfg: Config, layout: Layout, states: list[RankStates], hw: Hardware) -> StepTime:
    """The step time of the slowest pipeline rank plus the bubble, and the job's tokens/s."""
    ranks = tuple(rank_time(cfg, layout, st, hw) for st in states)
    busy = max(r.busy for r in ranks)
    bubble = 0.0
    if layout.pp > 1:
        m = layout.micro_batches(cfg.training.global_batch)
        per_mb = busy / m
        p, v = layout.pp, layout.stages_per_rank
        sched = layout.pp_schedule
        bubble = (p - 1) * per_mb * (1.0 if sched in ("gpipe", "1f1b") else
                                     1.0 / v if sched == "interleaved1f1b" else 1.0 / 6)
    step = busy + bubble
    tokens = cfg.training.global_batch * cfg.training.seq_len
    return StepTime(ranks, bubble, step, tokens / step)
