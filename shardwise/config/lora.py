"""The ``[lora]`` section: low-rank adapters trained on a frozen base (shardwise/models/lora.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.types import ConfigError


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA rank r of each adapter (0 = off: every weight trains). With r > 0 the base weights are
    frozen and each target linear W gains A (r x in, random) and B (out x r, zero): its output is
    x W^T + (alpha / r) x A^T B^T, equal to the base model's at step 0."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout), in [0, 1)."""
    targets: str = "all-linear"
    """The linears that get adapters: all-linear (every linear of attention and the feed-forward: not
    the output head, nor an MoE router's gate), or their names, comma-separated (the last part of the
    module name: wq, wk, wv, wo for attention, MLA's wq_a, wq_b, wkv_a, wkv_b; w1, w2, w3 for the MLP
    and a shared expert). The output head and the routed experts take none yet."""


def check_lora(cfg: LoRAConfig) -> None:
    """The ``[lora]`` values, one line each (before any model is built)."""
    if cfg.rank < 0:
        raise ConfigError(f"lora.rank must be >= 0 (0 = off), got {cfg.rank}")
    if not cfg.rank:
        return
    if not cfg.alpha > 0:
        raise ConfigError(f"lora.alpha must be > 0, got {cfg.alpha}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg.dropout}")
    if not [t for t in cfg.targets.split(",") if t.strip()]:
        raise ConfigError("lora.targets is empty: name the linears to adapt, e.g. --lora.targets=wq,wk,wv,wo")
