"""Analytic FLOPs per token for MFU (PaLM / torchtitan convention).

FLOPs per token = 6 * N + 6 * L * H * (d_qk + d_v) * S  =  6 * N + 12 * L * dim * S, where N counts
parameters that do matmuls (the input embedding is a lookup and is excluded unless it is tied to
the output head) and the attention term is not discounted for causal masking, so the figure
compares with torchtitan's and Megatron's published MFU tables. Exact executed FLOPs (causal-aware,
recompute included) are a separate, later measure.
"""

from __future__ import annotations

from shardwise.models.llama import ModelArgs


def num_params(args: ModelArgs, include_embedding: bool = True) -> int:
    d, L, hd = args.dim, args.n_layers, args.head_dim
    attn = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2  # wq, wo, wk, wv
    mlp = 3 * d * args.ffn_hidden_dim
    norms = 2 * d
    total = L * (attn + mlp + norms) + d  # + final norm
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else emb
    return total + head + (emb if include_embedding else 0)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, PaLM convention."""
    n = num_params(args, include_embedding=False)
    if args.tie_embeddings:
        n += args.vocab_size * args.dim  # the shared table does the output matmul
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
