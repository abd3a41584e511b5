"""Model presets as data. Shapes of the Llama-3 family follow Meta's published configs.

``debug`` matches torchtitan's debug model (dim 256, 6 layers, 16 heads, vocab 2048) so throughput
figures compare; ``125m`` is a GPT-3-small-sized Llama for CPU benchmarks; the large ones are used by
planning and must build on the meta device in well under a second.
"""

from __future__ import annotations

from shardwise.config.model_args import ModelArgs

_LLAMA3 = dict(rope_theta=500000.0, vocab_size=128256, multiple_of=1024, n_kv_heads=8)

# DeepSeek-V3: RoPE theta 1e4 with YaRN (factor 40 over 4,096 positions), sigmoid routing balanced by
# the routing bias, normalized top-k, RMSNorm eps 1e-6. n_kv_heads is unused by latent attention
# (every head gets its keys from the latent); it is set equal to n_heads.
_DEEPSEEK = dict(rope_theta=10000.0, rope_scaling="yarn", rope_scaling_factor=40.0,
                 rope_original_max_seq_len=4096, norm_eps=1e-6, moe_score="sigmoid", moe_balance="bias",
                 moe_route_norm=True)

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
    # DeepSeek-V3 family. The debug shape: 16 heads of latent attention (low-rank queries, a 96-wide
    # latent, heads of 16 + 16 RoPE channels, values 24 wide), 8 experts in 4 groups (top-2 from the 2
    # best groups), sigmoid routing balanced by bias, block 0 dense: 6.18M parameters active per token,
    # moe-debug's 6.17M (bench/families.py compares the two).
    "deepseek-debug": ModelArgs(**{**_DEEPSEEK, "rope_scaling_factor": 1.0}, dim=256, n_layers=6, n_heads=16,
                                n_kv_heads=16, vocab_size=2048, max_seq_len=2048,
                                q_lora_rank=96, kv_lora_rank=96, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                v_head_dim=24, n_experts=8, moe_top_k=2, moe_hidden_dim=256,
                                n_shared_experts=1, n_dense_layers=1, moe_n_groups=4, moe_topk_groups=2),
    # torchtitan's DeepSeek-V3 16B (the deepseek-moe-16b shape with latent attention; full queries),
    # routed as DeepSeek-V3 routes (sigmoid, bias balancing) where torchtitan's default is softmax.
    "deepseek-v3-16b": ModelArgs(**_DEEPSEEK, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16,
                                 vocab_size=102400,
                                 max_seq_len=16384, ffn_hidden_size=10944, q_lora_rank=0, kv_lora_rank=512,
                                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=64,
                                 moe_top_k=6, moe_hidden_dim=1408, n_shared_experts=2, n_dense_layers=1,
                                 moe_route_scale=1.0, rope_yarn_mscale=0.7, rope_yarn_mscale_all_dim=0.7),
    # DeepSeek-V3 671B (37B active), its published config.json: 61 blocks (3 dense), 128 heads of
    # latent attention, 256 routed experts in 8 groups (top-8 from 4 groups), one shared.
    "deepseek-v3-671b": ModelArgs(**_DEEPSEEK, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                                  vocab_size=129280,
                                  max_seq_len=163840, ffn_hidden_size=18432, q_lora_rank=1536,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  n_experts=256, moe_top_k=8, moe_hidden_dim=2048, n_shared_experts=1,
                                  n_dense_layers=3, moe_n_groups=8, moe_topk_groups=4, moe_route_scale=2.5,
                                  rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0),
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
    "deepseek-v3-16b": "DeepSeek-MoE 16B", "deepseek-v3-671b": "DeepSeek-V3",
}
"""Presets whose vocabulary is a model family's: they train with that family's tokenizer (the
others -- debug, moe-debug, 125m -- are shapes that train on the shipped one)."""


def vocab_beyond_padding(model_vocab: int, tokenizer_vocab: int) -> bool:
    """Whether a model's embedding has more rows than a tokenizer's ids by more than padding explains
    (families round their vocabularies up: Qwen3's 151,669 tokens to 151,936 rows)."""
    return model_vocab > tokenizer_vocab + max(1024, tokenizer_vocab // 64)
