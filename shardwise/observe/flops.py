"""Analytic FLOPs per token for MFU (PaLM / torchtitan convention).

FLOPs per token = 6 * N + 6 * L * H * (d_qk + d_v) * S  =  6 * N + 12 * L * H * d_head * S, where N
counts parameters that do matmuls for a token (for MoE: the router, the top-k routed experts and the
shared expert) (the input embedding is a lookup and is excluded unless it is tied to
the output head) and the attention term is not discounted for causal masking, so the figure
compares with torchtitan's and Megatron's published MFU tables. Exact executed FLOPs (causal-aware,
recompute included) are a separate, later measure.
"""

from __future__ import annotations

from shardwise.models.llama import ModelArgs


def num_params(args: ModelArgs, include_embedding: bool = True, active: bool = False) -> int:
    """Parameters of the model; ``active``: of an MoE model, those one token uses (its top-k
    routed experts, not all of them)."""
    d, L, hd = args.dim, args.n_layers, args.head_dim
    attn = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2  # wq, wo, wk, wv
    dense_mlp = 3 * d * args.ffn_hidden_dim
    n_moe = sum(args.is_moe_layer(i) for i in range(L))
    experts = args.moe_top_k if active else args.n_experts
    moe_mlp = d * args.n_experts + 3 * d * args.moe_hidden_dim * (experts + args.n_shared_experts)
    norms = 2 * d
    total = L * (attn + norms) + (L - n_moe) * dense_mlp + n_moe * moe_mlp + d  # + final norm
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else emb
    return total + head + (emb if include_embedding else 0)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, PaLM convention."""
    n = num_params(args, include_embedding=False, active=True)
    if args.tie_embeddings:
        n += args.vocab_size * args.dim  # the shared table does the output matmul
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
