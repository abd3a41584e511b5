"""``ModelArgs``: the shape and function of a model, as one frozen value. A leaf module outside the
``models`` package (no torch, no package imports), so the config -- whose ``[model]`` section is
derived from it -- and the processes that read only the config (the CLI, the data-preparation
workers) do not load torch and the models to get the field list."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# Fields that shape training, not the function the weights compute: the RoPE table's length (positions
# below both lengths rotate alike) and the balance terms' weights and scope, the bias's rate and rule,
# the z-loss and the router's initial spread. An HF config or a checkpoint need not match them.
TRAINING_CHOICES = ("max_seq_len", "moe_aux_coef", "moe_aux_scope", "moe_bias_rate", "moe_bias_update",
                    "moe_z_coef", "moe_router_init_std", "moe_router_lr_scale", "attn_qk_init_std")


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
    rope_scaling: Literal["llama3", "yarn"] = "llama3"
    """How RoPE frequencies are scaled when rope_scaling_factor != 1: Llama 3.1's rule, or YaRN
    (DeepSeek-V3: interpolation ramped between beta_slow and beta_fast rotations, with an
    attention-scale correction)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations over the original context above which a frequency is left alone."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is divided by the factor."""
    rope_yarn_mscale: float = 1.0
    """YaRN: scale of the RoPE rotation's magnitude correction (0.1 * mscale * ln(factor) + 1)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: the same correction applied to the softmax scale, squared (0 = none); the rotation's
    is then divided by it."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE table covers."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    head_size: int = 0
    """Per-head width; 0 = dim / n_heads (Qwen3-style models decouple the two)."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3's QK-norm)."""
    attn_qk_init_std: float = 0.02
    """Standard deviation of the query and key projections' initial weights (wq, wk; latent
    attention: wq_b or wq, and wkv_b's key rows). Latent attention has no QK-norm: at 0.02 its
    logits start near 0 and every token's attention output is about the context's mean."""
    q_lora_rank: int = 0
    """Multi-head latent attention: rank of the low-rank query projection (0 = a full query
    projection)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3): width of the compressed key-value latent;
    0 = grouped-query attention."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key channels without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key channels with RoPE (the key's are one head shared by all)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
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
    moe_balance: Literal["aux_loss", "bias", "bias+aux_loss", "none"] = "aux_loss"
    """Load balancing: aux_loss (sequence-wise), bias (auxiliary-loss-free routing bias), both
    (DeepSeek-V3: the bias, and a small sequence-wise loss), or none."""
    moe_aux_coef: float = 0.01
    """Weight of the balance loss (moe_balance=aux_loss or bias+aux_loss)."""
    moe_aux_scope: Literal["sequence", "batch"] = "sequence"
    """Over what the balance loss counts the experts' shares: each sequence (DeepSeek-V3's
    sequence-wise loss, averaged over the step's sequences) or the whole batch of every rank (the
    Switch Transformer / Mixtral loss, its token shares all-reduced over the data-parallel ranks)."""
    moe_bias_rate: float = 1e-3
    """Routing-bias step per optimizer step (moe_balance=bias or bias+aux_loss)."""
    moe_bias_update: Literal["sign", "proportional"] = "sign"
    """How the routing bias moves: by the rate towards balance (sign: DeepSeek-V3), or by the rate
    times each expert's load error relative to the mean (proportional: Loss-Free Balancing's variant)."""
    moe_router_init_std: float = 0.02
    """Standard deviation of the router's initial weights. Its logits start with a spread over the
    experts of about this times sqrt(dim): 0.02 gives 0.3 at width 256 but 0.9 at 2048."""
    moe_router_lr_scale: float = 1.0
    """The routers' learning rate relative to optimizer.lr. AdamW moves every weight by about the
    learning rate whatever its gradient, so a router whose inputs all point one way shifts every
    expert's logit by about lr times the input's L1 norm in one step; below 1 the routing bias keeps up."""
    moe_z_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2,
    which keeps the logits small; 0 = off. Independent of moe_balance."""
    n_dense_layers: int = 0
    """Leading blocks that keep the dense MLP in an MoE model."""
    moe_n_groups: int = 1
    """Group-limited routing (DeepSeek-V3): the experts form this many equal groups ..."""
    moe_topk_groups: int = 1
    """... and each token's experts come from the groups with the highest sums of their two best
    (biased) scores, this many of them."""

    @property
    def balance_loss(self) -> bool:
        """The sequence-wise balance loss is on (moe_balance aux_loss or bias+aux_loss, a weight > 0)."""
        return self.moe_balance in ("aux_loss", "bias+aux_loss") and self.moe_aux_coef > 0

    @property
    def balance_bias(self) -> bool:
        """The routing bias is updated after each step (moe_balance bias or bias+aux_loss)."""
        return self.moe_balance in ("bias", "bias+aux_loss")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (else grouped-query attention)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        """Per-head value (and attention output) width."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def kernel_head_dim(self) -> int:
        """Per-head width the attention kernel runs q, k and v at: latent attention pads the
        narrower of its query/key and value heads to the wider (models/mla.py)."""
        return max(self.qk_head_dim, self.value_head_dim)

    @property
    def rope_dim(self) -> int:
        """Channels each head rotates: the whole head, or MLA's RoPE part."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads attention runs with (MLA expands its latent into every head)."""
        return self.n_heads if self.mla else self.n_kv_heads

    @property
    def yarn_mscale(self) -> float:
        """YaRN's softmax-scale correction factor (1 without YaRN or mscale_all_dim)."""
        if self.rope_scaling != "yarn" or self.rope_scaling_factor <= 1 or not self.rope_yarn_mscale_all_dim:
            return 1.0
        return 0.1 * self.rope_yarn_mscale_all_dim * math.log(self.rope_scaling_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale: qk_head_dim**-0.5, times YaRN's correction squared."""
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2

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
