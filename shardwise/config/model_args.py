"""``ModelArgs``: the shape and function of a model, as one frozen value. A leaf module outside the
``models`` package (no torch, no package imports), so the config -- whose ``[model]`` section is
derived from it -- and the processes that read only the config (the CLI, the data-preparation
workers) do not load torch and the models to get the field list."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 256
    """Hidden size."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads."""
    n_kv_heads: int = 16
    """Key/value heads (grouped-query attention); must divide n_heads."""
    vocab_size: int = 2048
    """Embedding rows; must be at least the tokenizer's vocabulary."""
    ffn_dim_multiplier: float = 1.0
    """Llama-3 FFN width multiplier applied to 8/3*dim."""
    multiple_of: int = 256
    """FFN width is rounded up to a multiple of this."""
    ffn_hidden_size: int = 0
    """FFN (SwiGLU) width; 0 = Llama's rule from ffn_dim_multiplier and multiple_of. Set it for any
    other width (an imported model's intermediate_size)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling_factor: float = 1.0
    """Llama-3.1 RoPE frequency scaling factor (1.0 = no scaling)."""
    rope_low_freq_factor: float = 1.0
    """Llama-3.1 RoPE scaling: wavelengths above original_max_seq_len / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """Llama-3.1 RoPE scaling: wavelengths below original_max_seq_len / this are left alone."""
    rope_original_max_seq_len: int = 8192
    """Llama-3.1 RoPE scaling: the context length the model was first trained at."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE table covers."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    head_size: int = 0
    """Per-head width; 0 = dim / n_heads (Qwen3-style models decouple the two)."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3's QK-norm)."""
    n_experts: int = 0
    """Routed experts per MoE layer; 0 = dense model (see moe.py)."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_hidden_dim: int = 0
    """Hidden width of each expert's SwiGLU."""
    n_shared_experts: int = 0
    """Shared experts every token also goes through (fused into one MLP of n * moe_hidden_dim)."""
    moe_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax or sigmoid."""
    moe_route_norm: bool = True
    """Renormalize the chosen experts' scores to sum to 1."""
    moe_route_scale: float = 1.0
    """Multiplier on the routing weights."""
    moe_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """Load balancing: aux_loss (sequence-wise), bias (auxiliary-loss-free routing bias), or none."""
    moe_aux_coef: float = 0.01
    """Weight of the balance loss (moe_balance=aux_loss)."""
    moe_bias_rate: float = 1e-3
    """Routing-bias step per optimizer step (moe_balance=bias)."""
    n_dense_layers: int = 0
    """Leading blocks that keep the dense MLP in an MoE model."""

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and layer_id >= self.n_dense_layers

    @property
    def ffn_hidden_dim(self) -> int:
        """The SwiGLU width: ffn_hidden_size, or Llama's rule -- 2/3 of 4*dim, times the multiplier,
        rounded up to multiple_of."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * math.ceil(hidden / self.multiple_of)
