"""The decoder every family shares (Llama 3, Qwen3, DeepSeek-V3): RMSNorm, RoPE (Llama-3.1 and YaRN
frequency scaling), attention through ``scaled_dot_product_attention`` (grouped-query, optionally with
per-head norms, or multi-head latent attention: :mod:`shardwise.models.mla`; masked per document), and a
SwiGLU feed-forward, dense or routed (:mod:`shardwise.models.moe`). A family is a ``ModelArgs``.

The model runs no parallelism itself; it declares how the parallelisms split it (``model.plan``,
``block.plan``: :mod:`shardwise.models.protocol`), which ``parallel/`` applies. It is built on the meta
device, parallelized, moved with ``to_empty()`` and then filled by :func:`init_weights`, which draws
every parameter from a generator seeded by the run seed and the parameter's name: the same seed gives
the same weights on any layout.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from shardwise.config.model_args import ModelArgs
from shardwise.models.layers import (
    AttentionCore,
    DocumentSpans,
    FeedForward,
    KVCache,
    LayerCache,
    RMSNorm,
    apply_rope,
)
from shardwise.models.mla import LatentAttention
from shardwise.models.moe import MoE, routing_not_counted
from shardwise.models.protocol import BlockPlan, LinearGroup, ModelPlan
from shardwise.ops.autocast import compute_dtype
from shardwise.ops.chunked_ce import chunked_linear_cross_entropy


def rope_table(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """The rotation of every position: (max_seq_len, rope_dim // 2, 2) fp32, ``[..., 0]`` the cosine
    and ``[..., 1]`` the sine of ``pos * freq`` (the angles are computed in float64), times YaRN's
    magnitude correction where it has one."""
    d = args.rope_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float64) / d))
    magnitude = 1.0
    if args.rope_scaling_factor != 1.0 and args.rope_scaling == "yarn":
        freqs, magnitude = yarn_frequencies(args, freqs)
    elif args.rope_scaling_factor != 1.0:
        # Llama 3.1: leave high frequencies alone, divide low ones by the factor, blend between.
        old = args.rope_original_max_seq_len
        low_wavelen = old / args.rope_low_freq_factor
        high_wavelen = old / args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        smooth = (old / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor)
        blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(wavelen < high_wavelen, freqs,
                            torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor, blended))
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(t, freqs)  # (S, D/2)
    return (torch.stack((angles.cos(), angles.sin()), dim=-1) * magnitude).float()  # (S, D/2, 2)


def yarn_frequencies(args: ModelArgs, freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023) as DeepSeek-V3 uses it: frequencies that turn fewer than
    ``beta_slow`` times over the original context are divided by the factor, those that turn more
    than ``beta_fast`` times are kept, with a linear ramp between (over whole channel pairs);
    and the rotation's magnitude (the attention's temperature correction)."""
    d, factor, base = args.rope_dim, args.rope_scaling_factor, args.rope_theta
    old = args.rope_original_max_seq_len

    def channel(rotations: float) -> float:  # the channel whose frequency turns this often over `old`
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(channel(args.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(channel(args.rope_yarn_beta_slow)), d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=freqs.device) - low) / (high - low)).clamp(0, 1)
    freqs = freqs / factor * ramp + freqs * (1 - ramp)

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    if args.rope_yarn_mscale_all_dim:
        return freqs, mscale(args.rope_yarn_mscale) / mscale(args.rope_yarn_mscale_all_dim)
    return freqs, mscale(1.0)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.core = AttentionCore()
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Qwen3's QK-norm: one RMSNorm over head_dim, shared by every head (of q; of k).
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | DocumentSpans | None, cache: LayerCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # view(b, s, -1, head_dim): the head count follows the local shard under tensor parallel.
        q = self.wq(x).view(b, s, -1, self.head_dim)  # (B, S, H, D)
        k = self.wk(x).view(b, s, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.wv(x).view(b, s, -1, self.head_dim)  # (B, S, Hkv, D)
        if self.q_norm is not None:  # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # The table covers every position (or was indexed by explicit positions); take the length
        # attention actually sees, which under sequence parallel is the gathered one.
        rope = rope[:s] if rope.dim() == 3 else rope
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        if cache is not None:  # generation: attend to the earlier tokens' keys and values too
            k, v, mask = cache.update(k, v)  # (B, Hkv, T, D), T = earlier + S
        out = self.core(q, k, v, mask)  # (B, H, S, D)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, dim)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs, **moe: Any) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention: nn.Module = LatentAttention(args) if args.mla else Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: nn.Module = (MoE(args, layer_id=layer_id, **moe) if args.is_moe_layer(layer_id)
                                        else FeedForward(args.dim, args.ffn_hidden_dim))

    @property
    def plan(self) -> BlockPlan:
        """Tensor parallel: attention (whole heads per rank) and a dense SwiGLU are column- then
        row-parallel regions entered with a sequence all-gather; an MoE feed-forward stays on the
        sequence shard (each rank routes its own tokens), FSDP shards it over every rank that routes
        different tokens and expert parallel splits its experts. Context parallel rings the core."""
        common: dict = dict(sequence_norms=("attention_norm", "ffn_norm"), attention_core="attention.core",
                            head_norms=(), high_precision={})
        attention = self.attention
        if isinstance(attention, LatentAttention):
            # The expansions are split by heads; the compressions stay whole (mla.py says why).
            low_rank = ("wq_a", "q_norm") if attention.low_rank_q else ()
            groups = (LinearGroup("attention", ("wq_b" if attention.low_rank_q else "wq", "wkv_b"), ("wo",),
                                  inputs=3, replicated=(*low_rank, "wkv_a", "kv_norm"),
                                  shared=("shared_key",)),)
            why = "latent attention's compressions (whole on every tp rank, outside the float8 group)"
            common["high_precision"] = {f"attention.{n}": why for n in (*low_rank[:1], "wkv_a")}
        else:
            if attention.q_norm is not None:
                common["head_norms"] = ("attention.q_norm", "attention.k_norm")
            # (x, rope, mask): hidden states gathered; the RoPE table and document spans alike everywhere
            groups = (LinearGroup("attention", ("wq", "wk", "wv"), ("wo",), inputs=3),)
        ffn = self.feed_forward
        if not isinstance(ffn, MoE):
            return BlockPlan((*groups, LinearGroup("feed_forward", ("w1", "w3"), ("w2",))), **common)
        if ffn.shared_expert is not None:
            groups += (LinearGroup("feed_forward.shared_expert", ("w1", "w3"), ("w2",), split=False),)
        common["high_precision"].update({
            "feed_forward.router": "the MoE router stays in high precision (routing)",
            "feed_forward.experts": "grouped experts: no float8 grouped GEMM here"})
        return BlockPlan(groups, local=("feed_forward",), routed="feed_forward",
                         experts="feed_forward.experts", **common)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: DocumentSpans | None, cache: KVCache | None = None) -> torch.Tensor:
        a = self.attention_norm(x)
        # (without a cache, exactly the inputs tensor parallel's plan for the attention expects)
        a = self.attention(a, rope, mask) if cache is None else self.attention(a, rope, mask,
                                                                                cache.layer(self.layer_id))
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h))


def causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """(S, S) bool, True on and below the diagonal."""
    return torch.ones(s, s, dtype=torch.bool, device=device).tril()


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """The dense causal document mask, (B, S) ids -> (B, 1, S, S) bool: what :class:`DocumentSpans`
    computes without building it (the reference its tests compare against)."""
    causal = causal_mask(doc_ids.shape[1], doc_ids.device)
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal).unsqueeze(1)


class Transformer(nn.Module):
    plan = ModelPlan(embedding="tok_embeddings", norm="norm", head="output")
    """Its ends, for pipeline stages and tensor parallel (:mod:`shardwise.models.protocol`)."""

    def __init__(self, args: ModelArgs, sequences_per_step: int = 1,
                 sequence_group: dist.ProcessGroup | None = None,
                 batch_group: dist.ProcessGroup | None = None) -> None:
        """``sequences_per_step`` (global), ``sequence_group`` (the ranks sharing a sequence) and
        ``batch_group`` (every rank routing other tokens) reach the MoE blocks' balance loss; a dense
        model ignores them."""
        super().__init__()
        moe = dict(sequences_per_step=sequences_per_step, sequence_group=sequence_group,
                   batch_group=batch_group)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when layers are split
        # across pipeline stages.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args, **moe) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied embeddings reuse tok_embeddings.weight in forward: one parameter, nothing to re-tie
        # after to_empty() or sharding.
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # On meta the table is a shape only: init_weights computes it once materialized.
        table = torch.empty(args.max_seq_len, args.rope_dim // 2, 2)
        self.register_buffer("rope", table if table.is_meta else rope_table(args), persistent=False)
        # The sequence positions this rank's tokens hold, when context parallel shards the
        # sequence; init_weights then keeps only those rows of the RoPE table.
        self.rope_positions: torch.Tensor | None = None
        # doc ids (B, S) -> what attention masks by; context parallel puts its own here.
        self.document_spans: Any = DocumentSpans.of
        self.placeholder = False  # (true inside placeholder_forward)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                ignore_index: int = -100, loss_chunk: int = 4096, loss_compiled: bool = False,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, vocab). ``doc_ids`` (B, S) enables document masking;
        ``positions`` (B, S) overrides the RoPE positions (default 0..S-1).

        With ``labels`` (B, S) it returns the summed token cross-entropy instead (fp32 scalar),
        computed by the chunked linear + cross-entropy (``loss_chunk`` tokens at a time), so
        the logits never exist (``loss_compiled``: its softmax-gradient pass compiled).

        A pipeline stage without the embedding takes hidden states (B, S, dim) instead of tokens,
        and one without the head returns hidden states. ``cache`` (generation): the tokens continue
        the ones it holds (their positions follow), and it keeps their keys and values."""
        if cache is not None and positions is None:
            s = tokens.shape[1]
            positions = torch.arange(cache.length, cache.length + s, device=tokens.device)[None]  # (1, S)
        rope = self.rope[positions] if positions is not None else self.rope
        mask = self.document_spans(doc_ids) if doc_ids is not None else None
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, S, dim)
        # Under autocast (one rank without FSDP) the residual stream runs in its dtype (bf16), as with
        # FSDP's bf16 parameters: the one-rank run rounds as a multi-rank run does, at half the traffic.
        h = h.to(compute_dtype(h))
        for layer in self.layers.values():
            h = layer(h, rope, mask) if cache is None else layer(h, rope, mask, cache)
        if cache is not None:
            cache.length += h.shape[1]
        if self.norm is None:
            return h
        h = self.norm(h)
        if labels is not None:
            head = self.tok_embeddings.weight if self.output is None else self.output.weight  # (V, dim)
            return chunked_linear_cross_entropy(h, head, labels, reduction="sum",
                                                ignore_index=ignore_index, chunk_size=loss_chunk,
                                                compiled=loss_compiled)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)  # (B, S, vocab); through the module so tensor parallel's hooks apply

    @contextlib.contextmanager
    def placeholder_forward(self) -> Iterator[None]:
        """Forwards on placeholder inputs (a pipeline's shape inference): not counted towards the
        experts' token loads; ``self.placeholder`` is true meanwhile."""
        self.placeholder = True
        try:
            with routing_not_counted(self):
                yield
        finally:
            self.placeholder = False


# ---------------------------------------------------------------------------------------------
# Initialization


INIT_STD = 0.02
"""The std of every weight that has no rule of its own (projections, experts, the value rows)."""


def param_init_spec(name: str, args: ModelArgs) -> tuple[str, float]:
    """(kind, std) for a parameter: 'ones' for norms, else a truncated normal at ±3 std.

    Residual-branch outputs (wo, w2) are scaled down with depth (std 0.02 / sqrt(2 * (layer + 1))),
    the output head uses dim**-0.5, and an untied input embedding uses std 1 (it is followed by
    RMSNorm); a tied one uses the output head's scale. An MoE router uses ``moe_router_init_std``,
    the query and key projections ``attn_qk_init_std`` ('keys_values': latent attention's ``wkv_b``,
    whose key rows take that std and value rows ``INIT_STD``).
    """
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.endswith(".lora_a"):  # PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
        return "fan_in_uniform", 0.0
    if name.endswith(".lora_b"):  # zero: the adapted model starts as the base model
        return "zeros", 0.0
    if name == "tok_embeddings.weight":
        return "normal", args.dim**-0.5 if args.tie_embeddings else 1.0
    if name == "output.weight":
        return "normal", args.dim**-0.5
    if name.endswith("router.gate.weight"):
        return "normal", args.moe_router_init_std
    if name.endswith(("attention.wq.weight", "attention.wk.weight", "attention.wq_b.weight")):
        return "normal", args.attn_qk_init_std
    if name.endswith("attention.wkv_b.weight"):  # each head's key rows, then its value rows
        return "keys_values", args.attn_qk_init_std
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "shared_expert.w2.weight",
                      "experts.w2")):
        layer = int(name.split(".")[1])
        return "normal", INIT_STD / math.sqrt(2 * (layer + 1))
    return "normal", INIT_STD


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter from a generator seeded by (seed, parameter name), then the RoPE table
    (only this rank's positions under context parallel).

    Each full parameter is drawn on its own device and only the local shard is kept, so the result
    is independent of the layout (one full parameter exists at a time, never the whole model).
    """
    for name, p in model.named_parameters():
        kind, std = param_init_spec(name, model.args)
        with _one_process_draw():
            full = _draw(model, name, p, kind, std, seed)
        keep_shard(p, full)
    _reset_state(model)


@torch.no_grad()
def load_full_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill every parameter from ``tensors`` (name -> the full tensor, the same on every rank), each
    rank keeping its shard."""
    for name, p in model.named_parameters():
        keep_shard(p, tensors[name].to(torch.float32))


def keep_shard(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of ``full`` (the same full tensor on every rank, on ``p``'s device)
    into parameter ``p``."""
    if isinstance(p, DTensor):
        # src_data_rank=None: every rank holds the same full tensor; each keeps its shard, no comm.
        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    _local(p).copy_(full)


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    """Parameter ``name``'s own generator: the same draw on every rank and in every layout."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return g


def _draw(model: Transformer, name: str, p: torch.Tensor, kind: str, std: float, seed: int) -> torch.Tensor:
    """Parameter ``name``'s full initial value (fp32), from its (seed, name) generator."""
    full = torch.empty(p.shape, dtype=torch.float32, device=_local(p).device)
    if kind in ("ones", "zeros"):
        full.fill_(1.0 if kind == "ones" else 0.0)
    elif kind == "fan_in_uniform":
        bound = full.shape[-1] ** -0.5  # (r, in): 1/sqrt(in)
        full.uniform_(-bound, bound, generator=_generator(name, seed, full.device))
    else:
        g = _generator(name, seed, full.device)
        base = INIT_STD if kind == "keys_values" else std
        nn.init.trunc_normal_(full, std=base, a=-3 * base, b=3 * base, generator=g)
        if kind == "keys_values":  # a truncated normal scaled is one at the scaled std and bounds
            a = model.args
            rows = full.view(a.n_heads, a.qk_nope_head_dim + a.v_head_dim, -1)  # (H, nope + v, C)
            rows[:, :a.qk_nope_head_dim] *= std / base
    return full


def _one_process_draw() -> contextlib.AbstractContextManager:
    """Under simulated ranks (torch's LocalTensorMode: many ranks in one process) each full parameter is
    drawn once, as a plain tensor the ranks share: its truncated normal loops on the values it drew,
    which one process decides. Outside a simulation this is a no-op."""
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # (a torch without the simulation: nothing to step out of)
        return contextlib.nullcontext()
    return maybe_disable_local_tensor_mode()


def _reset_state(model: Transformer) -> None:
    """The MoE state (no routing bias, no tokens counted yet) and the RoPE table."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.router.expert_bias.zero_()
            m.tokens_per_expert.zero_()
    rope = rope_table(model.args, device=model.rope.device)
    if model.rope_positions is not None:
        rope = rope[model.rope_positions.to(rope.device)]  # (S/cp, D/2, 2): this cp rank's rows
    model.rope = rope


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class _SkipInitOnMeta(TorchFunctionMode):
    """Construction without torch's default initializers on meta tensors (nn.Linear's
    kaiming_uniform_, nn.Embedding's normal_, ...). On meta they compute nothing, yet they run
    through torch's Python reference kernels: about half of a large model's build on meta, which the
    planner (for every candidate layout) and every rank pay. ``init_weights`` initializes every
    parameter once the model is materialized."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_model(args: ModelArgs, device: torch.device | str = "meta", **moe: Any) -> Transformer:
    """Construct the model; on ``meta`` (the default) no memory is allocated (nor initializers
    run: :class:`_SkipInitOnMeta`). ``moe``: sequences_per_step, sequence_group and batch_group for the MoE
    balance loss (see Transformer)."""
    skip = _SkipInitOnMeta() if torch.device(device).type == "meta" else contextlib.nullcontext()
    with torch.device(device), skip:
        return Transformer(args, **moe)
