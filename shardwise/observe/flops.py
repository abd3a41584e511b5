"""FLOPs accounting: the PaLM-convention figure for MFU, and the FLOPs a step actually executes.

**PaLM convention** (:func:`flops_per_token`, what torchtitan's and Megatron's MFU tables use):
``6 * N + 12 * L * H * d_head * S`` per token, where ``N`` counts the parameters that do matmuls for
a token -- the input embedding is a lookup and is excluded unless tied to the output head; for MoE,
the router, the top-k routed experts and the shared expert -- and the attention term assumes every
query attends to all ``S`` keys (no causal discount). Under document masks the attention term counts
each document's own length instead of ``S`` (:func:`palm_flops`): masked-out pairs are no work.

**Executed FLOPs** (:func:`executed_flops`): what the kernels run.

- Matmuls: ``2 * N`` per token forward (multiply + add), backward ``2x`` forward (the gradients of
  the input and of the weight), so ``6 * N`` with backward.
- Attention per layer: ``2 * H * (d_qk + d_v)`` per (query, key) pair forward (``QK^T`` and ``PV``;
  query heads count, so GQA/MQA do not reduce it; latent attention's values run padded to d_qk),
  backward ``2.5x`` forward (flash-attention backward recomputes the scores and runs four more
  matmuls). The pairs are exact for the mask:
  ``S(S+1)/2`` per causal sequence, ``sum_d L_d(L_d+1)/2`` with document masks, ``sum_i min(i+1, w)``
  for a sliding window of ``w`` keys.
- Activation checkpointing: ``full`` re-runs each block's forward during backward (its matmuls and
  attention once more) -- except the MLP's down projection (w2, and the shared expert's), whose
  output only feeds the residual add: torch's non-reentrant checkpoint stops recomputing once every
  tensor backward needs exists again. ``layer`` does so for every n-th block; ``selective`` keeps
  matmul and attention outputs and recomputes only elementwise ops (not counted); ``none`` adds
  nothing. The chunked fused loss runs the output head's matmul once more in backward.

The two are reported as ``mfu`` (PaLM) and ``exec_util`` (executed FLOPs / peak).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.models.transformer import ModelArgs

# Backward-to-forward FLOP ratios: matmuls compute two gradients (input, weight) of the same size
# as the forward product; flash attention's backward recomputes QK^T then runs four matmuls.
MATMUL_BACKWARD = 2.0
ATTENTION_BACKWARD = 2.5


def num_params(args: ModelArgs, include_embedding: bool = True, active: bool = False) -> int:
    """Parameters of the model; ``active``: of an MoE model, those one token uses (its top-k
    routed experts, not all of them)."""
    d, L = args.dim, args.n_layers
    routed = 3 * d * args.moe_hidden_dim * (args.moe_top_k if active else args.n_experts)
    total = sum(sum(block_linears(args, i)) + (routed if args.is_moe_layer(i) else 0)
                for i in range(L)) + L * block_norm_params(args) + d  # + final norm
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else emb
    return total + head + (emb if include_embedding else 0)


def block_linears(args: ModelArgs, layer: int) -> list[int]:
    """Parameters of one block's linear layers (its matmuls but the routed experts' grouped ones),
    in the order its forward calls them; a dense MLP's or shared expert's down projection last."""
    d, h = args.dim, args.n_heads
    if args.mla:  # wq | wq_a, wq_b; wkv_a, wkv_b; wo
        q = [d * args.q_lora_rank, args.q_lora_rank * h * args.qk_head_dim] if args.q_lora_rank \
            else [d * h * args.qk_head_dim]
        kv = args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
        attention = [*q, d * (args.kv_lora_rank + args.qk_rope_head_dim), kv, h * args.v_head_dim * d]
    else:  # wq, wk, wv, wo
        q, kv = d * h * args.head_dim, d * args.n_kv_heads * args.head_dim
        attention = [q, kv, kv, q]
    if not args.is_moe_layer(layer):
        return [*attention, *[d * args.ffn_hidden_dim] * 3]  # w1, w3, w2
    shared = [d * args.moe_hidden_dim * args.n_shared_experts] * 3 if args.n_shared_experts else []
    return [*attention, d * args.n_experts, *shared]  # router, shared w1, w3, w2


def block_norm_params(args: ModelArgs) -> int:
    """Norm weights of one block: its two, plus QK-norm's or latent attention's."""
    if args.mla:
        return 2 * args.dim + args.q_lora_rank + args.kv_lora_rank
    return 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0)


def attention_width(args: ModelArgs, executed: bool = False) -> int:
    """Per head and (query, key) pair, the channels attention multiplies: the query/key width
    (``QK^T``) plus the value width (``PV``). ``executed``: as the kernel runs it, the values
    zero-padded to the query/key width where narrower (latent attention)."""
    v = args.kernel_head_dim if executed else args.value_head_dim
    return args.qk_head_dim + v


def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in a matmul for one token (active experts; the output head, but
    not an untied input embedding, which is a lookup; not the norms)."""
    norms = args.n_layers * block_norm_params(args) + args.dim
    n = num_params(args, include_embedding=False, active=True) - norms
    if args.tie_embeddings:
        n += args.vocab_size * args.dim  # the shared table does the output matmul
    return n


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, PaLM convention (norm weights included in
    ``N`` as torchtitan does); the attention term ``6 * L * H * (d_qk + d_v) * S``, which is
    PaLM's ``12 * L * H * d_head * S`` where the widths are equal."""
    return 6.0 * _palm_params(args) + 6.0 * args.n_layers * args.n_heads * attention_width(args) * seq_len


def palm_flops(args: ModelArgs, tokens: int, pairs: int | torch.Tensor) -> float | torch.Tensor:
    """PaLM-convention training FLOPs of ``tokens`` tokens whose causal attention covers ``pairs``
    (query, key) pairs (:func:`batch_pairs`). Under document masks the attention term counts each
    document's ``L^2`` pairs, as PaLM counts ``S^2`` per sequence (no causal discount): ``sum L^2 =
    2 * pairs - tokens``. Without masks it equals ``tokens * flops_per_token``."""
    attention = 6.0 * args.n_layers * args.n_heads * attention_width(args) * (2 * pairs - tokens)
    return 6.0 * _palm_params(args) * tokens + attention


def _palm_params(args: ModelArgs) -> int:
    n = num_params(args, include_embedding=False, active=True)
    return n + args.vocab_size * args.dim if args.tie_embeddings else n


def attention_pairs(seq_len: int, causal: bool = True, window: int = 0) -> int:
    """(query, key) pairs one sequence's attention computes: ``S^2`` without a mask, ``S(S+1)/2``
    causal, ``sum_i min(i+1, window)`` causal with a sliding window of ``window`` keys."""
    if not causal:
        return seq_len * seq_len
    if window <= 0 or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def document_pairs(doc_ids: torch.Tensor) -> torch.Tensor:
    """Pairs under a causal document mask, ``sum over documents L(L+1)/2``, for doc ids (B, S): a
    0-d tensor on their device (no host sync). Query i attends to its position in its document + 1
    keys."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts, idx, 0).cummax(dim=1).values  # (B, S) first index of the doc
    return (idx - doc_start + 1).sum()


@dataclass(frozen=True)
class StepFlops:
    """Executed FLOPs of a training step (forward + backward + recompute); the attention term is a
    0-d tensor when the pair count is (document masks, counted on the device)."""

    matmul: float
    attention: float | torch.Tensor

    @property
    def total(self) -> float | torch.Tensor:
        return self.matmul + self.attention


def batch_pairs(batches: list, seq_len: int) -> int | torch.Tensor:
    """Attention pairs of a step's micro-batches (objects with ``inputs`` (B, S) and ``doc_ids``)."""
    total: int | torch.Tensor = 0
    for b in batches:
        if b.doc_ids is not None:
            total = total + document_pairs(b.doc_ids)
        else:
            total = total + b.inputs.shape[0] * attention_pairs(seq_len)
    return total


def executed_flops(args: ModelArgs, tokens: int, pairs: int | torch.Tensor, recompute: str = "none",
                   every: int = 2, chunked_loss: bool = False) -> StepFlops:
    """FLOPs executed to train on ``tokens`` tokens whose attention computes ``pairs`` (query, key)
    pairs in all (per sequence, summed over sequences; see :func:`attention_pairs`).

    ``recompute`` is the activation-checkpointing mode: ``none``; ``full`` (every block's forward
    runs again in backward); ``layer`` (blocks ``0, every, 2*every, ...`` do); ``selective`` (matmul
    and attention outputs are kept, only elementwise ops rerun: no matmul or attention FLOPs);
    ``selective_half`` (every block's 2nd, 4th, ... linear layer runs again).
    ``chunked_loss``: the output head's logits are computed again in backward (the
    vocab-parallel chunked loss under tensor parallel; the fused loss on one rank or FSDP
    computes its gradients in forward and recomputes nothing)."""
    fwd_matmul = 2.0 * matmul_params(args) * tokens
    fwd_attn = 2.0 * args.n_layers * args.n_heads * attention_width(args, executed=True) * pairs
    matmul = fwd_matmul * (1 + MATMUL_BACKWARD)
    attention = fwd_attn * (1 + ATTENTION_BACKWARD)
    if recompute not in ("none", "full", "layer", "selective", "selective_half"):
        raise ValueError(f"unknown recompute mode {recompute!r}")
    if recompute == "selective_half":
        matmul += 2.0 * sum(_half_recomputed_params(args, i) for i in range(args.n_layers)) * tokens
    if recompute in ("full", "layer"):
        ids = [i for i in range(args.n_layers) if recompute == "full" or i % every == 0]
        matmul += 2.0 * sum(_recomputed_block_params(args, i) for i in ids) * tokens
        attention = attention + fwd_attn * len(ids) / args.n_layers
    if chunked_loss:
        matmul += 2.0 * args.vocab_size * args.dim * tokens
    return StepFlops(matmul, attention)


def _recomputed_block_params(args: ModelArgs, layer: int) -> int:
    """Matmul parameters per token of one checkpointed block's recompute: all of its forward but
    the down projections whose outputs only feed the residual add (the dense MLP's w2, the shared
    expert's), which torch's non-reentrant checkpoint stops before."""
    linears = block_linears(args, layer)
    if not args.is_moe_layer(layer):
        return sum(linears[:-1])
    routed = 3 * args.dim * args.moe_hidden_dim * args.moe_top_k
    return sum(linears[:-1] if args.n_shared_experts else linears) + routed


def _half_recomputed_params(args: ModelArgs, layer: int) -> int:
    """Matmul parameters per token that ``selective_half`` runs again in one block: its 2nd, 4th,
    ... linear layer (for Llama wk, wo, then the dense MLP's w3 or the shared expert's w1), but a
    last down projection, which only feeds the residual add and is not reached."""
    linears = block_linears(args, layer)
    if not args.is_moe_layer(layer) or args.n_shared_experts:
        linears = linears[:-1]
    return sum(linears[1::2])


# ---------------------------------------------------------------------------------------------
# Formulas for torch's FlopCounterMode where torch 2.13 has none (CPU attention, grouped GEMM).
# Like torch's own SDPA formulas they count every (query, key) pair: no causal discount.


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,  # noqa: ANN001
                       out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    # (N, a) x (G, a, b) -> (N, b), or the weight gradient (a, N) x (N, b) -> (G, a, b): every row
    # of the long dim is multiplied once, 2 * rows * a * b either way.
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _addmm(self_shape: tuple, a_shape: tuple, b_shape: tuple, *args, **kwargs) -> int:  # noqa: ANN002, ANN003
    """FlopCounterMode formula of ``acc.addmm_(a, b)``: the product's multiply-adds."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def flop_counter_formulas() -> dict:
    """``custom_mapping`` for ``torch.utils.flop_counter.FlopCounterMode``."""
    aten = torch.ops.aten
    # (torch counts addmm but not its in-place form, which the fused loss accumulates with)
    formulas = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
                aten.addmm_: _addmm}
    if hasattr(aten, "_grouped_mm"):
        formulas[aten._grouped_mm] = _grouped_mm
    return formulas
