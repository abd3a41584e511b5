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
from shardwise.parallel.pipeline import stage_layers
from shardwise.plan.layout import Layout
from shardwise.plan.schedule import schedule_actions
from shardwise.plan.states import BYTES, RankStates
from shardwise.resolve import loss_chunk_tokens


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
    loss_chunk: int = 0
    """Tokens per chunk of the fused loss (0: plain logits then cross-entropy)."""

    @property
    def fused_grads(self) -> bool:
        """The fused loss computes its gradients in forward (tp > 1: vocab-parallel, recomputed)."""
        return self.loss_chunk > 0 and self.tp == 1

    @property
    def loss_chunks(self) -> int:
        return -(-self.tokens // self.loss_chunk) if self.loss_chunk else 0

    @property
    def tokens(self) -> int:
        """Tokens the attention and FFN matmuls see (gathered over tp)."""
        return self.mb * self.seq

    @property
    def norm_tokens(self) -> int:
        """Tokens the norms and the residual stream hold (sequence-sharded over tp)."""
        return self.tokens // self.tp


def shape_of(cfg: Config, layout: Layout) -> Shape:
    args = model_args(cfg.model)
    seq = cfg.training.seq_len // layout.cp
    chunk = loss_chunk_tokens(cfg.training, args.vocab_size, layout.pp, layout.tp, layout.micro_batch * seq)
    return Shape(args, layout.micro_batch, seq, layout.tp, layout.cp, layout.ep,
                 BYTES[cfg.training.mixed_precision], chunk)


def _norm(s: Shape, tokens: int) -> int:
    """RMSNorm in fp32: input copy (the input itself in fp32), normalized, 1/rms, fp32 weight copy
    (none when the weight is already fp32)."""
    d = s.args.dim
    return 8 * tokens * d + 4 * tokens + (4 * d if s.e < 4 else 0)


def dense_ffn(s: Shape, tokens: int, hidden: int) -> int:
    """SwiGLU saved tensors after its input: w1 x, silu(w1 x), w3 x, product."""
    return 4 * s.e * tokens * hidden


def attention(s: Shape) -> int:
    """Attention block after the norm: gathered input, q, k (post-RoPE), v, out, log-sum-exp; with
    QK-norm, its two norms."""
    a, t = s.args, s.tokens
    hq, hkv, dh = a.n_heads // s.tp, a.n_kv_heads // s.tp, a.head_dim
    out = s.e * t * a.dim + s.e * t * dh * (2 * hq + 2 * hkv) + 4 * s.mb * hq * s.seq
    if a.qk_norm:  # RMSNorm per head of q and k, as _norm: fp32 input, normalized, 1/rms, weight copy
        out += 8 * t * dh * (hq + hkv) + 4 * t * (hq + hkv) + (8 * dh if s.e < 4 else 0)
    if s.cp > 1:  # ring attention's output is (B, H, S, D): the projection input is a copy
        out += s.e * t * hq * dh
    return out


def mask_saved(s: Shape, cfg: Config) -> int:
    """With document masking, attention converts the (B, 1, S, S) boolean mask to the compute dtype
    and saves that copy, in every block."""
    return s.e * s.mb * s.seq * s.seq if cfg.data.document_mask else 0


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
    n = 2 * _norm(s, s.norm_tokens) + attention(s) + mask_saved(s, cfg)
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
    n += e * t * hq * dh + 4 * s.mb * hq * s.seq + mask_saved(s, cfg)  # attention out, lse, mask
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


def backward_temporaries(s: Shape, layer: int) -> int:
    """Gradient temporaries alive inside one block's backward: at the MLP, the gradients of its
    hidden product, of both branches and of the SiLU input (four hidden-sized tensors); at
    attention, those of q, k, v and the output -- whichever is larger."""
    a = s.args
    if a.is_moe_layer(layer):
        mlp = 4 * s.e * s.norm_tokens * a.moe_top_k * a.moe_hidden_dim
    else:
        mlp = 4 * s.e * s.tokens * (a.ffn_hidden_dim // s.tp)
    attn = s.e * s.tokens * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads) // s.tp
    return max(mlp, attn)


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
    """Final norm, output projection input and the loss's saved tensors (the fused loss: the final
    norm, the valid-token count and the two gradients it computed in forward)."""
    a, t = s.args, s.tokens
    if s.fused_grads:  # the gradients of the hidden states and of the head, computed in forward
        return _norm(s, s.norm_tokens) + 8 + s.e * t * a.dim + _head_grad_bytes(s)
    n = _norm(s, s.norm_tokens) + 8 * t + 8  # + labels and the global valid-token count (int64)
    if s.loss_chunk:
        return n + s.e * t * a.dim  # the chunked loss keeps the hidden states, not the logits
    vocab = a.vocab_size // s.tp if s.tp > 1 and cfg.parallel.loss_parallel else a.vocab_size
    return n + s.e * t * a.dim + 4 * t * vocab + 4  # log-softmax output (fp32), total weight


def _head_grad_bytes(s: Shape) -> int:
    """The fused loss's head-gradient sum: one chunk's product as it is, or fp32 over chunks."""
    return (s.e if s.loss_chunks == 1 else 4) * s.args.vocab_size * s.args.dim


def loss_temporaries(s: Shape, cfg: Config) -> int:
    """Memory the loss holds beyond its saved tensors at its peak.

    Plain logits: the compute-dtype logits and two fp32 logits-sized gradient temporaries (loss
    parallel: one more compute-dtype copy, the local shard of the DTensor's redistribution). Fused
    loss, gradients in forward: the larger of one chunk's softmax pass (its logits, their fp32
    copy, the compute-dtype gradient) and the backward's scaled copies of the two gradients.
    Vocab-parallel chunked loss: one chunk's logits in the compute dtype and fp32, its softmax
    gradient in both, the fp32 weight-gradient accumulator and the hidden-state gradient."""
    a = s.args
    vocab = a.vocab_size // s.tp if s.tp > 1 and cfg.parallel.loss_parallel else a.vocab_size
    if s.fused_grads:
        c = -(-s.tokens // s.loss_chunks)  # equal chunks
        softmax = c * vocab * (s.e + 4 + (s.e if s.e != 4 else 0))
        scaled = s.e * s.tokens * a.dim + s.e * vocab * a.dim
        return max(softmax, scaled)
    if s.loss_chunk:
        c = min(s.loss_chunk, s.tokens)
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


@dataclass
class Timeline:
    """Running total of live bytes; remembers the peak and where it happened."""

    live: int = 0
    peak: int = 0
    where: str = ""
    parts: dict[str, int] = field(default_factory=dict)
    peak_parts: dict[str, int] = field(default_factory=dict)

    def add(self, part: str, nbytes: int, where: str) -> None:
        self.run([(part, nbytes)], 1, where)

    def run(self, events: list[tuple[str, int]], times: int, where: str) -> None:
        """Apply ``events`` (part, bytes) ``times`` times over, e.g. one block's for a run of
        identical blocks: the peak of the repetition is in its first pass if a pass frees more
        than it allocates, else in its last, so one pass over the events finds it."""
        if times <= 0 or not events:
            return
        total, parts, best, best_parts = 0, {}, None, {}
        for part, n in events:
            total += n
            parts[part] = parts.get(part, 0) + n
            if best is None or total > best:
                best, best_parts = total, dict(parts)
        j = times - 1 if total > 0 else 0
        if self.live + j * total + best > self.peak:
            self.peak, self.where = self.live + j * total + best, where
            keys = set(self.parts) | set(parts)
            self.peak_parts = {k: self.parts.get(k, 0) + j * parts.get(k, 0) + best_parts.get(k, 0)
                               for k in keys}
        self.live += times * total
        for k, v in parts.items():
            self.parts[k] = self.parts.get(k, 0) + times * v


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


def _runs(layers: list[int], signature: dict[int, tuple]) -> list[list[int]]:
    """Consecutive layers grouped into runs of identical signature."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and signature[runs[-1][-1]] == signature[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _rank_activations(cfg: Config, s: Shape, st: RankStates) -> tuple[dict[int, int], dict[int, int],
                                                                     dict[str, int]]:
    """(saved bytes per block under checkpointing, without it, the rank's saved bytes by part) for
    one micro-batch."""
    kinds = {}  # the formulas depend on the block's kind and checkpointing only
    per_block, full_block = {}, {}
    for i in st.layers:
        key = (s.args.is_moe_layer(i), _ac_kind(cfg, i))
        if key not in kinds:
            kinds[key] = (block_activations(s, cfg, i), block_saved(s, cfg, i))
        per_block[i], full_block[i] = kinds[key]
    acts = {"blocks": sum(per_block.values()) + (rope_table(s, cfg) if st.layers else 0),
            "embedding": embedding_saved(s) if st.has_embedding else 0,
            "head": head_saved(s, cfg) if st.has_head else 0}
    return per_block, full_block, acts


def memory_floor(cfg: Config, layout: Layout, st: RankStates) -> int:
    """A lower bound of :func:`step_memory`'s peak, without replaying the step: what is live when
    the first backward starts, counting only allocations that nothing frees before it (parameter
    and optimizer shards, the RoPE table, and one micro-batch's saved activations and loss
    temporaries; under pp the gathered units and the warm-up forwards' activations). The planner
    drops a layout whose floor is over capacity before timing its pipeline (most of the search's
    cost on large models, where most layouts do not fit)."""
    s = shape_of(cfg, layout)
    per_block, _, acts = _rank_activations(cfg, s, st)
    base = st.params + st.optimizer + rope_table(s, cfg)
    if layout.pp == 1:
        loss = loss_temporaries(s, cfg) if st.has_head else 0
        return base + acts["embedding"] + sum(per_block.values()) + acts["head"] + loss
    gathered = sum(s.e * u.numel for u in st.units)
    n_stages = layout.pp * layout.stages_per_rank
    per_stage = stage_layers(s.args.n_layers, n_stages)
    warmup = 0
    for kind, stage in schedule_actions(layout, layout.micro_batches(cfg.training.global_batch), st.pp_rank):
        if kind != "F":
            break
        warmup += ((acts["embedding"] if stage == 0 else 0) + (acts["head"] if stage == n_stages - 1 else 0)
                   + sum(per_block[i] for i in per_stage[stage]))
    return base + gathered + warmup


def step_memory(cfg: Config, layout: Layout, st: RankStates) -> RankMemory:
    """Simulate one steady-state step of the rank with states ``st``; its peak and breakdown."""
    s = shape_of(cfg, layout)
    e, red = s.e, BYTES[cfg.parallel.fsdp_reduce_dtype] if s.e == 2 else 4
    m = layout.micro_batches(cfg.training.global_batch)
    per_block, full_block, acts = _rank_activations(cfg, s, st)
    units: dict[int | None, list] = {}
    for u in st.units:
        units.setdefault(u.layer, []).append(u)
    tl = Timeline()
    tl.add("params", st.params, "start")
    tl.add("optimizer", st.optimizer, "start")
    tl.add("buffers", rope_table(s, cfg), "start")

    def gather(us: list, where: str) -> None:
        tl.run(_gather_events(us, e), 1, where)

    if layout.pp > 1:
        _pipeline_timeline(tl, cfg, layout, st, s, m, per_block, full_block, acts, gather)
    else:
        order = list(st.layers)
        # One-unit model (parallel/fsdp.py one_unit): the root gathers every block with itself; a
        # block's gradients appear in its backward and wait for the root's reduce at the end.
        held = {i: n for u in units.get(None, []) for i, n in u.blocks}
        sig = {i: (per_block[i], full_block[i], tuple((u.numel, u.reshard) for u in units.get(i, [])),
                   held.get(i, 0)) for i in order}
        ends = acts["embedding"]  # (the RoPE table attention saves is the model's buffer)
        # Micro-batches after the second repeat it exactly (gradients exist from the first on).
        for mb in range(min(m, 2)):
            first = mb == 0
            tag = f" (micro-batch {mb + 1}/{m})" if m > 1 else ""
            gather(units.get(None, []), "forward root" + tag)
            tl.add("activations", ends, "forward" + tag)
            for run in _runs(order, sig):
                us = units.get(run[0], [])
                events = _gather_events(us, e) + [("activations", per_block[run[0]])]
                events += [("unsharded params", -e * u.numel) for u in us if u.reshard]
                tl.run(events, len(run), f"forward {_span(run)}" + tag)
            tl.add("activations", acts["head"], "loss" + tag)
            tl.add("loss", loss_temporaries(s, cfg), "loss backward" + tag)
            tl.add("loss", -loss_temporaries(s, cfg), "loss backward" + tag)
            tl.add("activations", -acts["head"], "loss backward" + tag)
            for run in _runs(list(reversed(order)), sig):
                i, us = run[0], units.get(run[0], [])
                recompute = full_block[i] - per_block[i]  # checkpointed: the forward runs again
                temps = backward_temporaries(s, i)
                events = _gather_events([u for u in us if u.reshard], e) + [("recompute", recompute)]
                # the weight gradients appear while the block's gradient temporaries are alive
                events += [("unsharded grads", e * u.numel) for u in us]
                events += [("unsharded grads", e * held[i])] if i in held else []
                events += [("backward temporaries", temps), ("backward temporaries", -temps)]
                events += _reduce_events(us, e, red, first) + [("recompute", -recompute),
                                                               ("activations", -per_block[i])]
                events += [("unsharded params", -e * u.numel) for u in us]
                tl.run(events, len(run), f"backward {_span(run)}" + tag)
            tl.add("activations", -ends, "backward root" + tag)
            root = units.get(None, [])
            own = [e * (u.numel - sum(n for _, n in u.blocks)) for u in root]  # held blocks' are there
            tl.run([("unsharded grads", n) for n in own] + _reduce_events(root, e, red, first)
                   + [("unsharded params", -e * u.numel) for u in root], 1, "backward root" + tag)
    saved = tl.peak_parts.get("activations", 0)
    return RankMemory(st.pp_rank, st.params, st.grads, st.optimizer, saved, tl.peak, tl.where,
                      tl.peak_parts)


def _ac_kind(cfg: Config, layer: int) -> str:
    ac = cfg.activation_checkpoint
    if ac.mode == "layer":
        return "full" if layer % ac.every == 0 else "none"
    return ac.mode


def _span(run: list[int]) -> str:
    return f"layers.{run[0]}" if len(run) == 1 else f"layers.{run[0]}..{run[-1]}"


def _gather_events(units: list, e: int) -> list[tuple[str, int]]:
    """An FSDP all-gather: the unsharded parameters, and the gather output while it is copied out."""
    out = []
    for u in units:
        out += [("unsharded params", e * u.numel), ("fsdp buffers", e * u.numel),
                ("fsdp buffers", -e * u.numel)]
    return out


def _reduce_events(units: list, e: int, red: int, first: bool) -> list[tuple[str, int]]:
    """A reduce-scatter of the unsharded gradients (already counted): its reduce-dtype input buffer,
    and on the first micro-batch the sharded gradient it allocates -- while the unsharded gradients
    are still alive (FSDP2 drops its references after the copy-in, autograd's go after the
    collective: measured with one unit holding the whole model, where the order sets the peak).
    Later micro-batches reduce into a new output that is then added to the sharded gradient."""
    out = []
    for u in units:
        output = ("grads", 4 * u.numel // u.shard) if first else ("fsdp buffers", red * u.numel // u.shard)
        out += [("fsdp buffers", red * u.numel), output, ("unsharded grads", -e * u.numel)]
        out += [] if first else [("fsdp buffers", -output[1])]
        out.append(("fsdp buffers", -red * u.numel))
    return out


def weight_inputs(s: Shape, layer: int) -> int:
    """What a block keeps between its input-gradient and weight-gradient passes (zero-bubble
    schedules): the inputs of its linear layers."""
    a = s.args
    n = 2 * s.e * s.tokens * a.dim + s.e * s.tokens * a.n_heads * a.head_dim // s.tp
    if a.is_moe_layer(layer):
        return n + s.e * s.norm_tokens * a.moe_top_k * a.moe_hidden_dim
    return n + s.e * s.tokens * a.ffn_hidden_dim // s.tp


def _pipeline_timeline(tl: Timeline, cfg: Config, layout: Layout, st: RankStates, s: Shape, m: int,
                       per_block: dict[int, int], full_block: dict[int, int], acts: dict[str, int],
                       gather) -> None:  # noqa: ANN001
    """A pipeline rank's step: its units stay gathered; each forward adds its stage's activations
    for one micro-batch, each backward frees them (block by block the first time, which also
    allocates the stage's gradients: they accumulate unsharded in the reduce dtype until the one
    reduce-scatter at the end, torch's schedules syncing gradients on the last micro-batch only)."""
    red = BYTES[cfg.parallel.fsdp_reduce_dtype] if s.e == 2 else 4
    units = list(st.units)
    gather(units, "forward")
    grads: dict[int | None, int] = {}
    for u in units:
        grads[u.layer] = grads.get(u.layer, 0) + red * u.numel
    n_stages = layout.pp * layout.stages_per_rank
    per_stage = stage_layers(s.args.n_layers, n_stages)
    loss = loss_temporaries(s, cfg) if st.has_head else 0
    stage_acts, keep = {}, {}
    for stage in {x for _, x in schedule_actions(layout, m, st.pp_rank)}:
        ends = (acts["embedding"] if stage == 0 else 0) + (acts["head"] if stage == n_stages - 1 else 0)
        stage_acts[stage] = ends + sum(per_block[i] for i in per_stage[stage])
        keep[stage] = sum(weight_inputs(s, i) for i in per_stage[stage])
    done: set[int | None] = set()  # stages whose gradients exist (None: the root's)

    def root_grads(stage: int, where: str) -> None:
        """Mark the stage's gradients allocated; the embedding / head ones with the first of them."""
        done.add(stage)
        if None not in done and stage in (0, n_stages - 1):
            tl.add("unsharded grads", grads.get(None, 0), where)
            done.add(None)

    for n, (kind, stage) in enumerate(schedule_actions(layout, m, st.pp_rank)):
        where = f"{'forward' if kind == 'F' else 'backward'} (stage {stage}, pass {n + 1})"
        if kind == "F":
            tl.add("activations", stage_acts[stage], where)
            continue
        if kind in ("B", "I") and stage == n_stages - 1:
            tl.run([("loss", loss), ("loss", -loss)], 1, where)
        if kind == "W":  # weight gradients: the kept linear inputs go, the gradients may appear
            events = [] if stage in done else [("unsharded grads", grads.get(i, 0)) for i in per_stage[stage]]
            tl.run(events + [("activations", -keep[stage])], 1, where)
            root_grads(stage, where)
            continue
        layers = per_stage[stage]
        sig = {i: (per_block[i], full_block[i], grads.get(i, 0)) for i in layers}
        for run in _runs(list(reversed(layers)), sig):
            i = run[0]
            recompute, temps = full_block[i] - per_block[i], backward_temporaries(s, i)
            events = [("unsharded grads", grads.get(i, 0))] if kind == "B" and stage not in done else []
            events += [("recompute", recompute), ("backward temporaries", temps),
                       ("backward temporaries", -temps), ("recompute", -recompute),
                       ("activations", -per_block[i])]
            tl.run(events, len(run), where)
        ends = stage_acts[stage] - sum(per_block[i] for i in layers)
        tl.add("activations", -ends + (keep[stage] if kind == "I" else 0), where)
        if kind == "B":
            root_grads(stage, where)
    # at the end of the schedule the gradients are reduce-scattered
    for u in units:
        tl.run([("grads", 4 * u.numel // u.shard), ("unsharded grads", -red * u.numel)], 1,
               "gradient reduction")
