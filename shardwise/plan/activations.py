"""Activation bytes per op: what this code base's autograd saves for backward, per block and per
micro-batch, under any layout.

**Activations** (:func:`activations`) are counted op by op from what this code base's autograd
saves for backward -- each tensor with its shape and dtype under the layout (sequence-parallel norms
on ``T/tp`` tokens, gathered linear inputs on ``T``, heads and FFN width split by ``tp``, ``S/cp``
positions per context-parallel rank). The formulas were read off the model's saved tensors and are
checked against them (tests/unit/test_plan.py). Per block, bf16, no checkpointing:

- each RMSNorm: the fp32 input copy, the fp32 normalized tensor, 1/rms per token, the fp32 weight;
- the two linear inputs (attention, FFN), gathered over tp under sequence parallel;
- attention: post-RoPE q and k, v, the output and its log-sum-exp (flash attention saves no
  ``S x S`` matrix); under cp the output-projection input is a separate copy;
- SwiGLU: ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product;
- MoE: router scores, choices and weights, sort order, the routed tokens and each expert GEMM's
  output (``k`` slots per token), the shared expert like a dense FFN.

Checkpointing keeps each checkpointed block's input only (``full``, ``layer``), or (``selective``)
the input plus every matmul, attention and collective output (the per-op policy's cache;
``selective_half``: every second linear-layer matmul output is left out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from shardwise.config.schema import Config
from shardwise.models import ModelArgs
from shardwise.models.moe import group_alignment
from shardwise.parallel.ac import is_checkpointed
from shardwise.plan.states import BYTES
from shardwise.resolve.run import ResolvedRun


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
    pp: int = 1
    cpu: bool = False
    """Whether the ranks are CPU processes: their MoE expert groups are zero-padded
    (:func:`expert_rows`)."""
    ep_load: float = 1.0
    """The busiest expert-parallel rank's routed slots over a balanced rank's (:func:`ep_rank_load`)."""

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


def shape_of(run: ResolvedRun) -> Shape:
    """The per-rank sizes of ``run``'s micro-batch."""
    d = run.dims
    return Shape(run.model, run.micro_batch, run.local_seq, d.tp, d.cp, d.ep, BYTES[run.precision],
                 run.loss_chunk, d.pp, _on_cpu(run.device_type),
                 ep_rank_load(run.cfg.parallel.expert_load, run.model.n_experts, d.ep))


def ep_rank_load(load: float, n_experts: int, ep: int) -> float:
    """The busiest expert-parallel rank's routed slots over the mean, when the busiest expert takes
    ``load`` times the mean and the others share the rest evenly: that expert's rank holds it and
    ``E/ep - 1`` average others. 1 without expert parallel (every rank routes its own tokens to all
    experts), ``load`` itself with one expert per rank."""
    if ep == 1 or load == 1:
        return 1.0
    local = n_experts // ep
    rest = (n_experts - load) / (n_experts - 1)  # each other expert's load
    return (load + (local - 1) * rest) / local


@functools.lru_cache(maxsize=8)
def _on_cpu(run_device: str) -> bool:
    """Whether ``run.device`` is the CPU (the planner fills it for the device it plans for; ``auto``
    is this machine's: the planner resolves without detecting the device)."""
    if run_device != "auto":
        return run_device == "cpu"
    import torch

    return not torch.cuda.is_available()


def expert_rows(s: Shape) -> int:
    """Rows the routed experts' grouped GEMMs run per micro-batch on this rank: its routed slots
    (under expert parallel, the busiest rank's: ``parallel.expert_load``, balanced by default) and, on
    CPU ranks, each local expert's zero rows up to a multiple of
    :func:`~shardwise.models.moe.group_alignment`: half of one on average."""
    a = s.args
    slots = round(s.norm_tokens * a.moe_top_k * s.ep_load)  # (the busiest rank's, under expert parallel)
    if not s.cpu:
        return slots
    local = max(1, a.n_experts // s.ep)
    return slots + round(local * (group_alignment(slots, local) - 1) / 2)


class AttentionLinear(NamedTuple):
    inp: int
    """Input width on one tp rank."""
    out: int
    split: bool
    """Split by heads over tp (else whole on every rank: latent attention's compressions)."""
    reads_hidden: bool
    """Reads the block's (gathered) hidden states."""


def attention_linears(a: ModelArgs, tp: int) -> list[AttentionLinear]:
    """A block's attention linears on one tp rank, in forward order: wq, wk, wv, wo; or latent
    attention's wq_a, wq_b (or wq), wkv_a, wkv_b, wo."""
    d, h, L = a.dim, a.n_heads // tp, AttentionLinear
    if not a.mla:
        q, kv = h * a.head_dim, a.n_kv_heads * a.head_dim // tp
        return [L(d, q, True, True), L(d, kv, True, True), L(d, kv, True, True), L(q, d, True, False)]
    qk = h * a.qk_head_dim
    q = [L(d, a.q_lora_rank, False, True), L(a.q_lora_rank, qk, True, False)] if a.q_lora_rank \
        else [L(d, qk, True, True)]
    return [*q, L(d, a.kv_lora_rank + a.qk_rope_head_dim, False, True),
            L(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), True, False),
            L(h * a.v_head_dim, d, True, False)]


def _norm(s: Shape, tokens: int, width: int = 0) -> int:
    """RMSNorm in fp32 over ``width`` channels (default dim): input copy (the input itself in fp32),
    normalized, 1/rms, fp32 weight copy (none when the weight is already fp32)."""
    d = width or s.args.dim
    return 8 * tokens * d + 4 * tokens + (4 * d if s.e < 4 else 0)


def dense_ffn(s: Shape, tokens: int, hidden: int) -> int:
    """SwiGLU saved tensors after its input: w1 x, silu(w1 x), w3 x, product."""
    return 4 * s.e * tokens * hidden


def attention(s: Shape, documents: bool = False) -> int:
    """Attention block after the norm: gathered input, q, k (post-RoPE), v, out, log-sum-exp; with
    QK-norm, its two norms. Under cp with ``documents`` (document masks, parallel/context.py) the
    whole window's K and V are kept instead of this rank's."""
    a, t = s.args, s.tokens
    if a.mla:
        return latent_attention(s, documents)
    hq, hkv, dh = a.n_heads // s.tp, a.n_kv_heads // s.tp, a.head_dim
    kv = s.cp if documents else 1
    out = s.e * t * a.dim + s.e * t * dh * (2 * hq + 2 * hkv * kv) + 4 * s.mb * hq * s.seq
    if a.qk_norm:  # RMSNorm per head of q and k, as _norm: fp32 input, normalized, 1/rms, weight copy
        out += 8 * t * dh * (hq + hkv) + 4 * t * (hq + hkv) + (8 * dh if s.e < 4 else 0)
    if s.cp > 1:  # ring attention's output is (B, H, S, D): the projection input is a copy
        out += s.e * t * hq * dh
    return out


def latent_attention(s: Shape, documents: bool = False) -> int:
    """Latent attention after the norm (models/mla.py), on the gathered tokens: the input of the
    compressions; the query latent through its norm into wq_b; the key-value latent through its norm
    into wkv_b (in fp32 the norm keeps the whole compression output, of which the latent is a view);
    q, k and v as the kernel takes them, padded to one width W, its output and log-sum-exp; and the
    output projection's input, the first v channels of each head copied out (or, at W = v, the
    output itself -- a copy under cp, as for grouped-query attention)."""
    a, t, e = s.args, s.tokens, s.e
    h, c, r = a.n_heads // s.tp, a.kv_lora_rank, a.qk_rope_head_dim
    v, w = a.value_head_dim, a.kernel_head_dim
    n = e * t * a.dim
    if a.q_lora_rank:
        n += _norm(s, t, a.q_lora_rank) + e * t * a.q_lora_rank
    n += _norm(s, t, c) + (4 * t * r if e == 4 else 0) + e * t * c
    # q and k: their own tensors (concatenated, padded); v: padded, else a view of wkv_b's output;
    # under cp with document masks k and v are kept gathered over the window instead
    if documents and s.cp > 1:
        n += e * t * h * w + 2 * e * t * h * w * s.cp
    else:
        n += 2 * e * t * h * w + e * t * h * (w if v < w else a.qk_nope_head_dim + v)
    n += e * t * h * w + 4 * s.mb * h * s.seq  # output, log-sum-exp
    if v < w or s.cp > 1:
        n += e * t * h * v
    return n


def moe_ffn(s: Shape, cfg: Config) -> int:
    """MoE feed-forward on this rank's (sequence-shard) tokens, after the norm."""
    a = s.args
    t, k, E, h = s.norm_tokens, a.moe_top_k, a.n_experts, a.moe_hidden_dim
    slots = t * k  # expert-parallel ranks receive about as many slots as they send
    n = s.e * t * a.dim + 4 * t * E + 8 * slots + 8 * slots  # router input, scores, choices, order
    if s.e < 4:  # the router's fp32 product (models/moe.py): fp32 copies of its input and weight
        n += 4 * t * a.dim + 4 * E * a.dim
    if a.moe_route_norm:
        n += 4 * slots + 4 * t  # the chosen weights and their sum
    if a.moe_z_coef > 0:  # logsumexp keeps the fp32 logits and its output
        n += 4 * t * E + 4 * t
    if a.balance_loss:
        n += 4 * t + 4 * s.mb * E + 4 * s.mb * (E + 1)  # score sums, f, per-sequence counts
    n += 3 * 4 * (E // s.ep)  # grouped GEMM offsets
    # the experts: their (padded) input and SwiGLU tensors, the output and the weights that scale it;
    # the sort order and token index; on CPU each slot's row in the padded groups
    rows = expert_rows(s)
    n += s.e * (rows * (a.dim + 4 * h) + 2 * slots * a.dim) + 2 * 8 * slots + s.e * slots
    if s.cpu:
        n += 8 * slots
    if a.n_shared_experts:
        n += dense_ffn(s, t, a.n_shared_experts * h)
    return n


def block_saved(s: Shape, cfg: Config, layer: int) -> int:
    """Bytes a block saves for backward in one micro-batch without checkpointing."""
    a = s.args
    n = 2 * _norm(s, s.norm_tokens) + attention(s, cfg.data.document_mask)
    if a.is_moe_layer(layer):
        return n + moe_ffn(s, cfg)
    return n + s.e * s.tokens * a.dim + dense_ffn(s, s.tokens, a.ffn_hidden_dim // s.tp)


def linear_outputs(s: Shape, layer: int) -> list[int]:
    """Bytes of each linear-layer matmul output of one block, in the order the forward runs them:
    attention's (wq, wk, wv, wo; or latent attention's), then the dense MLP's w1, w3, w2, or the
    router's gate and the shared expert's w1, w3, w2 (the routed experts are grouped GEMMs, not
    linear layers)."""
    a, t, tn, e = s.args, s.tokens, s.norm_tokens, s.e
    out = [e * t * x.out for x in attention_linears(a, s.tp)]
    if not a.is_moe_layer(layer):
        f = a.ffn_hidden_dim // s.tp
        return out + [e * t * f, e * t * f, e * t * a.dim]
    out.append(e * tn * a.n_experts)
    if a.n_shared_experts:
        hs = a.n_shared_experts * a.moe_hidden_dim
        out += [e * tn * hs, e * tn * hs, e * tn * a.dim]
    return out


def block_selective(s: Shape, cfg: Config, layer: int) -> int:
    """Selective checkpointing keeps the block input and every attention / collective output and
    linear-layer matmul output (``selective_half``: the 1st, 3rd, 5th, ... of the matmuls)."""
    a, t, tn, e = s.args, s.tokens, s.norm_tokens, s.e
    hq = a.n_heads // s.tp
    n = e * tn * a.dim  # the block input
    step = 2 if cfg.activation_checkpoint.mode == "selective_half" else 1
    n += sum(linear_outputs(s, layer)[::step])
    # attention out (heads as wide as the kernel runs them), log-sum-exp, mask
    n += e * t * hq * a.kernel_head_dim + 4 * s.mb * hq * s.seq
    if s.tp > 1:
        n += e * t * a.dim + e * tn * a.dim  # attention: input all-gather, output reduce-scatter
    if a.is_moe_layer(layer):
        return n + e * expert_rows(s) * (2 * a.moe_hidden_dim + a.dim)  # the routed expert GEMMs
    if s.tp > 1:
        n += e * t * a.dim + e * tn * a.dim  # MLP: input all-gather, output reduce-scatter
    return n


def backward_temporaries(s: Shape, layer: int) -> int:
    """Gradient temporaries alive inside one block's backward: at the MLP, the gradients of its
    hidden product, of both branches and of the SiLU input (four hidden-sized tensors); at
    attention, those of q, k, v and the output -- whichever is larger."""
    a = s.args
    if a.is_moe_layer(layer):
        mlp = 4 * s.e * expert_rows(s) * a.moe_hidden_dim
    else:
        mlp = 4 * s.e * s.tokens * (a.ffn_hidden_dim // s.tp)
    if a.mla:  # the gradients of q, k, v (padded to one width) and of the output
        attn = 4 * s.e * s.tokens * a.kernel_head_dim * (a.n_heads // s.tp)
    else:
        attn = s.e * s.tokens * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads) // s.tp
    return max(mlp, attn)


def block_activations(s: Shape, cfg: Config, layer: int) -> int:
    """Bytes kept from a block's forward until its backward, per micro-batch, under the
    activation-checkpointing mode."""
    ac = cfg.activation_checkpoint
    if not is_checkpointed(layer, ac):
        return block_saved(s, cfg, layer)
    if ac.mode in ("selective", "selective_half"):
        return block_selective(s, cfg, layer)
    return s.e * s.norm_tokens * s.args.dim  # the block input only


def rope_table_bytes(s: Shape, cfg: Config) -> int:
    """The RoPE rotations attention saves (one table shared by all blocks): the whole table, or
    under cp this rank's rows."""
    rows = s.seq if s.cp > 1 else s.args.max_seq_len
    return 8 * rows * (s.args.rope_dim // 2)


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

    Plain logits: two fp32 logits-sized gradient temporaries, and (loss parallel) the gradient's
    copy through the DTensor's reshape in the compute dtype, plus its downcast from fp32 when that
    is narrower (measured: 12 bytes per logit in bf16 and in fp32); the logits themselves
    only under pipeline parallel, whose stage keeps its output until its backward (``TokenLoss``
    drops them once the loss has saved its fp32 log-softmax). Fused
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
    parallel = s.e + (s.e if s.e < 4 else 0)  # the DTensor reshape's copy (+ the downcast from fp32)
    per_logit = 8 + (parallel if s.tp > 1 and cfg.parallel.loss_parallel else 0) + (s.e if s.pp > 1 else 0)
    return s.tokens * vocab * per_logit


def embedding_saved(s: Shape) -> int:
    return 8 * s.mb * s.seq  # token ids (int64)


def activations(run: ResolvedRun, layers: tuple[int, ...], has_embedding: bool,
                has_head: bool) -> dict[str, int]:
    """Saved bytes of one micro-batch on a rank running ``layers``: blocks, embedding, head/loss."""
    s, cfg = shape_of(run), run.cfg
    blocks = sum(block_activations(s, cfg, i) for i in layers)
    out = {"blocks": blocks + (rope_table_bytes(s, cfg) if layers else 0)}
    out["embedding"] = embedding_saved(s) if has_embedding else 0
    out["head"] = head_saved(s, cfg) if has_head else 0
    return out
