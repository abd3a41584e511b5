"""Model presets as data. Shapes of the Llama-3 family follow Meta's published configs.

``debug`` matches torchtitan's debug model (dim 256, 6 layers, 16 heads, vocab 2048) so throughput
figures compare; ``125m`` is a GPT-3-small-sized Llama for CPU benchmarks; the large ones are used by
planning and must build on the meta device in well under a second.
"""

from __future__ import annotations

from shardwise.config.model_args import ModelArgs

_LLAMA3 = dict(rope_theta=500000.0, vocab_size=128256, multiple_of=1024, n_kv_heads=8)

PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
                       multiple_of=256, max_seq_len=2048),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000,
                      multiple_of=256, max_seq_len=2048),
    # Llama 3.2 1B / 3B: tied embeddings, RoPE scaling factor 32.
    "1b": ModelArgs(**{**_LLAMA3, "multiple_of": 256}, dim=2048, n_layers=16, n_heads=32,
                    ffn_dim_multiplier=1.5, tie_embeddings=True, rope_scaling_factor=32.0,
                    max_seq_len=131072),
    "3b": ModelArgs(**{**_LLAMA3, "multiple_of": 256}, dim=3072, n_layers=28, n_heads=24,
                    ffn_dim_multiplier=1.0, tie_embeddings=True, rope_scaling_factor=32.0,
                    max_seq_len=131072),
    # MoE: the debug shape with 8 routed experts (top-2) and a shared expert in all but block 0.
    "moe-debug": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
                           multiple_of=256, max_seq_len=2048, n_experts=8, moe_top_k=2,
                           moe_hidden_dim=256, n_shared_experts=1, n_dense_layers=1),
    # Qwen3-0.6B: QK-norm, head width 128 with dim 1024 (GQA 16/8), FFN 3072, tied embeddings.
    "qwen3-0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_size=128,
                            ffn_hidden_size=3072, vocab_size=151936, max_seq_len=40960,
                            rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=True),
    # Qwen3-30B-A3B: 48 blocks of QK-norm attention (head width 128 with dim 2048, GQA 32/4) and 128
    # experts (top-8, width 768). 30.5B parameters, 3.3B active per token.
    "qwen3-30b-a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_size=128,
                               vocab_size=151936, ffn_hidden_size=6144, max_seq_len=40960,
                               rope_theta=1000000.0, norm_eps=1e-6, n_experts=128, moe_top_k=8,
                               moe_hidden_dim=768, moe_aux_coef=0.001, qk_norm=True),
    # Llama 3.1 8B / 70B / 405B: RoPE scaling factor 8.
    "8b": ModelArgs(**_LLAMA3, dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3,
                    rope_scaling_factor=8.0, max_seq_len=131072),
    "70b": ModelArgs(**{**_LLAMA3, "multiple_of": 4096}, dim=8192, n_layers=80, n_heads=64,
                     ffn_dim_multiplier=1.3, rope_scaling_factor=8.0, max_seq_len=131072),
    "405b": ModelArgs(**{**_LLAMA3, "multiple_of": 4096}, dim=16384, n_layers=126, n_heads=128,
                      ffn_dim_multiplier=1.2, rope_scaling_factor=8.0, max_seq_len=131072),
}


FAMILY_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("1b", "3b", "8b", "70b", "405b"), "Llama 3"),
    **dict.fromkeys(("qwen3-0.6b", "qwen3-30b-a3b"), "Qwen3"),
}
"""Presets whose vocabulary is a model family's: they train with that family's tokenizer (the
others -- debug, moe-debug, 125m -- are shapes that train on the shipped one)."""


def vocab_beyond_padding(model_vocab: int, tokenizer_vocab: int) -> bool:
    """Whether a model's embedding has more rows than a tokenizer's ids by more than padding explains
    (families round their vocabularies up: Qwen3's 151,669 tokens to 151,936 rows)."""
    return model_vocab > tokenizer_vocab + max(1024, tokenizer_vocab // 64)
