"""Per-rank memory of a training step: activations per op, and the peak of a step's timeline.

**Activations** (:func:`activations`) are counted op by op from what this code base's autograd
saves for backward -- each tensor with its shape and dtype under the layout (sequence-parallel norms
on ``T/tp`` tokens, gathered linear inputs on ``T``, heads and FFN width split by ``tp``, ``S/cp``
positions per context-parallel rank). The formulas were read off the model's saved tensors and are
checked against them (tests/unit/test_plan_memory.py). Per block, bf16, no checkpointing:

- each RMSNorm: the fp32 input copy, the fp32 normalized tensor, 1/rms per token, the fp32 weight;
- the two linear inputs (attention, FFN), gathered over tp under sequence parallel;
- attention: post-RoPE q and k, v, the output and its log-sum-exp (flash attention saves no
  ``S x S`` matrix); under cp the output-projection input is a separate copy;
- SwiGLU: ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product;
- MoE: router scores, choices and weights, sort order, the routed tokens and each expert GEMM's
  output (``k`` slots per token), the shared expert like a dense FFN.

Checkpointing keeps each checkpointed block's input only (``full``, ``layer``), or (``selective``)
the input plus every matmul, attention and collective output (the per-op policy's cache).

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

from shardwise.config import Config
from shardwise.models import ModelArgs, model_args
from shardwise.plan.layout import Layout
from shardwise.plan.states import BYTES, RankStates


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes the activation formulas need, for one micro-batch."""

    args: ModelArgs
    mb: int
    """Sequences per micro-batch."""
    seq: int
    """Positions per sequence on this rank (S / cp)."""
    tp: int
    cp: int
    ep: int
    e: int
    """Bytes per element of the compute dtype (2 bf16, 4 fp32)."""

    @property
    def tokens(self) -> int:
        """Tokens the attention and FFN matmuls see (gathered over tp)."""
        return self.mb * self.seq

    @property
    def norm_tokens(self) -> int:
        """Tokens the norms and the residual stream hold (sequence-sharded over tp)."""
        return self.tokens // self.tp


def shape_of(cfg: Config, layout: Layout) -> Shape:
    return Shape(model_args(cfg.model), layout.micro_batch, cfg.training.seq_len // layout.cp, layout.tp,
                 layout.cp, layout.ep, BYTES[cfg.training.mixed_precision])


def _norm(s: Shape, tokens: int) -> int:
    """RMSNorm in fp32: input copy (the input itself in fp32), normalized, 1/rms, fp32 weight copy
    (none when the weight is already fp32)."""
    d = s.args.dim
    return 8 * tokens * d + 4 * tokens + (4 * d if s.e < 4 else 0)


def dense_ffn(s: Shape, tokens: int, hidden: int) -> int:
    """SwiGLU saved tensors after its input: w1 x, silu(w1 x), w3 x, product."""
    return 4 * s.e * tokens * hidden


def attention(s: Shape) -> int:
    """Attention block after the norm: gathered input, q, k (post-RoPE), v, out, log-sum-exp."""
    a, t = s.args, s.tokens
    hq, hkv, dh = a.n_heads // s.tp, a.n_kv_heads // s.tp, a.head_dim
    out = s.e * t * a.dim + s.e * t * dh * (2 * hq + 2 * hkv) + 4 * s.mb * hq * s.seq
    if s.cp > 1:  # ring attention's output is (B, H, S, D): the projection input is a copy
        out += s.e * t * hq * dh
    return out


def moe_ffn(s: Shape, cfg: Config) -> int:
    """MoE feed-forward on this rank's (sequence-shard) tokens, after the norm."""
    a = s.args
    t, k, E, h = s.norm_tokens, a.moe_top_k, a.n_experts, a.moe_hidden_dim
    slots = t * k  # expert-parallel ranks receive about as many slots as they send
    n = s.e * t * a.dim + 4 * t * E + 8 * slots + 8 * slots  # router input, scores, choices, order
    if a.moe_route_norm:
        n += 4 * slots + 4 * t  # the chosen weights and their sum
    if a.moe_balance == "aux_loss" and a.moe_aux_coef > 0:
        n += 4 * t + 4 * s.mb * E + 4 * s.mb * (E + 1)  # score sums, f, per-sequence counts
    n += 3 * 4 * (E // s.ep)  # grouped GEMM offsets
    n += s.e * slots * (3 * a.dim + 4 * h) + 2 * 8 * slots + s.e * slots  # experts, indices, weights
    if a.n_shared_experts:
        n += dense_ffn(s, t, a.n_shared_experts * h)
    return n


def block_saved(s: Shape, cfg: Config, layer: int) -> int:
    """Bytes a block saves for backward in one micro-batch without checkpointing."""
    a = s.args
    n = 2 * _norm(s, s.norm_tokens) + attention(s)
    if a.is_moe_layer(layer):
        return n + moe_ffn(s, cfg)
    return n + s.e * s.tokens * a.dim + dense_ffn(s, s.tokens, a.ffn_hidden_dim // s.tp)


def block_selective(s: Shape, cfg: Config, layer: int) -> int:
    """Selective checkpointing keeps the block input and every matmul / attention / collective
    output of the block."""
    a, t, tn, e = s.args, s.tokens, s.norm_tokens, s.e
    hq, hkv, dh = a.n_heads // s.tp, a.n_kv_heads // s.tp, a.head_dim
    n = e * tn * a.dim  # the block input
    n += e * t * dh * (hq + 2 * hkv) + e * t * a.dim  # q, k, v and output projections
    n += e * t * hq * dh + 4 * s.mb * hq * s.seq  # attention output and log-sum-exp
    if s.tp > 1:
        n += e * t * a.dim + e * tn * a.dim  # attention: input all-gather, output reduce-scatter
    if a.is_moe_layer(layer):
        h, slots = a.moe_hidden_dim, tn * a.moe_top_k
        n += e * tn * a.n_experts + e * slots * (2 * h + a.dim)  # router logits, expert GEMMs
        if a.n_shared_experts:
            n += e * tn * (2 * a.n_shared_experts * h + a.dim)
        return n
    n += e * t * (2 * (a.ffn_hidden_dim // s.tp) + a.dim)  # w1, w3, w2 outputs
    if s.tp > 1:
        n += e * t * a.dim + e * tn * a.dim
    return n


def block_activations(s: Shape, cfg: Config, layer: int) -> int:
    """Bytes kept from a block's forward until its backward, per micro-batch, under the
    activation-checkpointing mode."""
    ac = cfg.activation_checkpoint
    checkpointed = ac.mode in ("full", "selective") or (ac.mode == "layer" and layer % ac.every == 0)
    if not checkpointed:
        return block_saved(s, cfg, layer)
    if ac.mode == "selective":
        return block_selective(s, cfg, layer)
    return s.e * s.norm_tokens * s.args.dim  # the block input only


def rope_table(s: Shape, cfg: Config) -> int:
    """The RoPE rotations attention saves (one table shared by all blocks): the whole table, or
    under cp this rank's rows."""
    rows = s.seq if s.cp > 1 else s.args.max_seq_len
    return 8 * rows * (s.args.head_dim // 2)


def head_saved(s: Shape, cfg: Config) -> int:
    """Final norm, output projection input and the loss's saved tensors."""
    a, t = s.args, s.tokens
    n = _norm(s, s.norm_tokens) + 8 * t  # + labels (int64)
    if cfg.training.loss_chunk:
        return n + s.e * t * a.dim  # the chunked loss keeps the hidden states, not the logits
    vocab = a.vocab_size // s.tp if s.tp > 1 and cfg.parallel.loss_parallel else a.vocab_size
    return n + s.e * t * a.dim + 4 * t * vocab + 4  # log-softmax output (fp32), total weight


def loss_temporaries(s: Shape, cfg: Config) -> int:
    """Memory the loss holds beyond its saved tensors at its backward.

    Plain logits: the compute-dtype logits and two fp32 logits-sized gradient temporaries (loss
    parallel: one more compute-dtype copy, the local shard of the DTensor's redistribution). Chunked
    loss: one chunk's logits in the compute dtype and fp32, its softmax gradient in both, the fp32
    weight-gradient accumulator and the hidden-state gradient."""
    a = s.args
    vocab = a.vocab_size // s.tp if s.tp > 1 and cfg.parallel.loss_parallel else a.vocab_size
    if cfg.training.loss_chunk:
        c = min(cfg.training.loss_chunk, s.tokens)
        return c * vocab * (2 * s.e + 8) + 4 * vocab * a.dim + s.e * s.tokens * a.dim
    per_logit = 2 * s.e + 8 if s.tp > 1 and cfg.parallel.loss_parallel else s.e + 8
    return s.tokens * vocab * per_logit


def embedding_saved(s: Shape) -> int:
    return 8 * s.mb * s.seq  # token ids (int64)


def activations(cfg: Config, layout: Layout, layers: tuple[int, ...], has_embedding: bool,
                has_head: bool) -> dict[str, int]:
    """Saved bytes of one micro-batch on a rank running ``layers``: blocks, embedding, head/loss."""
    s = shape_of(cfg, layout)
    blocks = sum(block_activations(s, cfg, i) for i in layers)
    out = {"blocks": blocks + (rope_table(s, cfg) if layers else 0)}
    out["embedding"] = embedding_saved(s) if has_embedding else 0
    out["head"] = head_saved(s, cfg) if has_head else 0
    return out


# ---------------------------------------------------------------------------------------------
# Pipeline: micro-batches in flight


def in_flight(layout: Layout, micro_batches: int, pp_rank: int) -> float:
    """Micro-batches of this rank's full activations held at once by the pipeline schedule.

    GPipe holds all of them; 1F1B ``pp - rank`` (Narayanan et al., 2021); interleaved 1F1B
    ``(v - 1) * pp + 2 * (pp - 1 - rank) + 1`` chunks of ``1/v`` each (torch's warm-up count); the
    V schedules (ZB-V, DualPipeV) about ``pp`` (Qi et al., 2024)."""
    m, p, r = micro_batches, layout.pp, pp_rank
    if p == 1:
        return 1.0
    sched = layout.pp_schedule
    if sched == "gpipe":
        return float(m)
    if sched == "1f1b":
        return float(min(m, p - r))
    if sched == "interleaved1f1b":
        v = layout.pp_stages_per_rank
        return min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) / v
    return float(min(m, p + (1 if sched == "dualpipev" else 0)))


# ---------------------------------------------------------------------------------------------
# The step timeline


@dataclass
class Timeline:
    """Running total of live bytes; remembers the peak and where it happened."""

    live: int = 0
    peak: int = 0
    where: str = ""
    parts: dict[str, int] = field(default_factory=dict)
    peak_parts: dict[str, int] = field(default_factory=dict)

    def add(self, part: str, nbytes: int, where: str) -> None:
        self.live += nbytes
        self.parts[part] = self.parts.get(part, 0) + nbytes
        if self.live > self.peak:
            self.peak, self.where, self.peak_parts = self.live, where, dict(self.parts)


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


def step_memory(cfg: Config, layout: Layout, st: RankStates) -> RankMemory:
    """Simulate one steady-state step of the rank with states ``st``; its peak and breakdown."""
    s = shape_of(cfg, layout)
    e, red = s.e, BYTES[cfg.parallel.fsdp_reduce_dtype] if s.e == 2 else 4
    m = layout.micro_batches(cfg.training.global_batch)
    acts = activations(cfg, layout, st.layers, st.has_embedding, st.has_head)
    per_block = {i: block_activations(s, cfg, i) for i in st.layers}
    full_block = {i: block_saved(s, cfg, i) for i in st.layers}
    units = {u.layer: [] for u in st.units}
    for u in st.units:
        units[u.layer].append(u)
    tl = Timeline()
    tl.add("params", st.params, "start")
    tl.add("optimizer", st.optimizer, "start")
    tl.add("buffers", rope_table(s, cfg), "start")

    def gather(us: list, where: str) -> None:
        for u in us:
            tl.add("unsharded params", e * u.numel, where)
            tl.add("fsdp buffers", e * u.numel, where)  # gather output while it is copied out
            tl.add("fsdp buffers", -e * u.numel, where)

    def reduce(us: list, where: str, first: bool) -> None:
        for u in us:
            tl.add("unsharded grads", e * u.numel, where)
            tl.add("fsdp buffers", red * u.numel, where)  # reduce-scatter input
            tl.add("unsharded grads", -e * u.numel, where)
            if first:  # the sharded gradient is allocated by the first reduction
                tl.add("grads", 4 * u.numel // u.shard, where)
            tl.add("fsdp buffers", -red * u.numel, where)

    order = list(st.layers)
    if layout.pp > 1:
        _pipeline_timeline(tl, cfg, layout, st, s, m, per_block, full_block, acts, gather)
    else:
        # Micro-batches after the second repeat it exactly (gradients exist from the first on).
        for mb in range(min(m, 2)):
            first = mb == 0
            tag = f" (micro-batch {mb + 1}/{m})" if m > 1 else ""
            gather(units.get(None, []), "forward root" + tag)
            tl.add("activations", acts["embedding"] + (rope_table(s, cfg) if order else 0), "forward" + tag)
            for i in order:
                gather(units.get(i, []), f"forward layers.{i}" + tag)
                tl.add("activations", per_block[i], f"forward layers.{i}" + tag)
                for u in units.get(i, []):
                    if u.reshard:
                        tl.add("unsharded params", -e * u.numel, f"forward layers.{i}" + tag)
            tl.add("activations", acts["head"], "loss" + tag)
            tl.add("loss", loss_temporaries(s, cfg), "loss backward" + tag)
            tl.add("loss", -loss_temporaries(s, cfg), "loss backward" + tag)
            tl.add("activations", -acts["head"], "loss backward" + tag)
            for i in reversed(order):
                where = f"backward layers.{i}" + tag
                gather([u for u in units.get(i, []) if u.reshard], where)
                if per_block[i] != full_block[i]:  # checkpointed: the forward runs again first
                    tl.add("recompute", full_block[i] - per_block[i], where + " (recompute)")
                reduce(units.get(i, []), where, first)
                if per_block[i] != full_block[i]:
                    tl.add("recompute", -(full_block[i] - per_block[i]), where)
                tl.add("activations", -per_block[i], where)
                for u in units.get(i, []):
                    tl.add("unsharded params", -e * u.numel, where)
            tl.add("activations", -(acts["embedding"] + (rope_table(s, cfg) if order else 0)),
                   "backward root" + tag)
            reduce(units.get(None, []), "backward root" + tag, first)
            for u in units.get(None, []):
                tl.add("unsharded params", -e * u.numel, "backward root" + tag)
    saved = tl.peak_parts.get("activations", 0)
    return RankMemory(st.pp_rank, st.params, st.grads, st.optimizer, saved, tl.peak, tl.where,
                      tl.peak_parts)


def pipeline_actions(layout: Layout, micro_batches: int, pp_rank: int) -> list[str]:
    """The order of this rank's forward (F) and backward (B) passes over its chunks in a step, up to
    the point after which memory only repeats or falls: all forwards then the first backward
    (GPipe), or warm-up forwards then two rounds of one backward and one forward (1F1B; the
    interleaved and V schedules are treated alike at chunk granularity, with their warm-up depth
    from :func:`in_flight`). Every later round holds what the second does."""
    v = layout.stages_per_rank
    n = micro_batches * v
    if layout.pp_schedule == "gpipe":
        return ["F"] * n + ["B"]
    warmup = min(n, max(1, round(in_flight(layout, micro_batches, pp_rank) * v)))
    return ["F"] * warmup + ["B", "F"] * min(n - warmup, 2) + ["B"]


def _pipeline_timeline(tl: Timeline, cfg: Config, layout: Layout, st: RankStates, s: Shape, m: int,
                       per_block: dict[int, int], full_block: dict[int, int], acts: dict[str, int],
                       gather) -> None:  # noqa: ANN001
    """A pipeline rank's step: its units stay gathered, each forward adds one chunk's activations,
    each backward frees them block by block (the first allocating the gradients, which accumulate
    unsharded in the reduce dtype until the one reduce-scatter at the end: torch's schedules sync
    gradients on the last micro-batch only)."""
    red = BYTES[cfg.parallel.fsdp_reduce_dtype] if s.e == 2 else 4
    v = layout.stages_per_rank
    units = list(st.units)
    gather(units, "forward")
    blocks = list(st.layers)
    chunks = [blocks[i::v] for i in range(v)] if v > 1 else [blocks]
    ends = int((acts["embedding"] + acts["head"] + rope_table(s, cfg)) / v)
    forwards = backwards = 0
    for act in pipeline_actions(layout, m, st.pp_rank):
        if act == "F":
            chunk = chunks[forwards % v]
            tl.add("activations", ends + sum(per_block[i] for i in chunk), f"forward (chunk {forwards + 1})")
            forwards += 1
            continue
        chunk = chunks[backwards % v]
        where = f"backward (chunk {backwards + 1})"
        if st.has_head:
            tl.add("loss", loss_temporaries(s, cfg), where)
            tl.add("loss", -loss_temporaries(s, cfg), where)
        for i in reversed(chunk):
            if backwards < v:  # the first backward of each chunk allocates its gradients
                for u in units:
                    if u.layer == i:
                        tl.add("unsharded grads", red * u.numel, where)
            tl.add("recompute", full_block[i] - per_block[i], where)
            tl.add("recompute", per_block[i] - full_block[i], where)
            tl.add("activations", -per_block[i], where)
        if backwards == 0:
            for u in units:
                if u.layer is None:
                    tl.add("unsharded grads", red * u.numel, where)
        tl.add("activations", -ends, where)
        backwards += 1
    # (the rest of the schedule holds less; at its end the gradients are reduce-scattered)
    for u in units:
        tl.add("grads", 4 * u.numel // u.shard, "gradient reduction")
        tl.add("unsharded grads", -red * u.numel, "gradient reduction")
