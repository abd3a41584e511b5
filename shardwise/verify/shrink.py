"""``verify --shrink N``: the planned model narrowed so hundreds of simulated ranks fit one machine.

Kept: everything that decides how a layout cuts the model and schedules it -- the block count (so
the pipeline's stages and their remainder), the head and key/value-head counts (tensor parallel's
divisibility), the vocabulary (the vocab-parallel embedding and head, and FSDP's uneven chunks of
them), and every expert, shared-expert, top-k and routing-group count. Scaled: the hidden widths,
each divided by N -- the model width, the head width, the feed-forward widths (dense and expert) and
latent attention's ranks and head parts. A width N does not divide is refused, naming it and the
largest factor that divides them all. An MoE model's routed experts hold most of its bytes (the
DeepSeek-V3 671B model narrowed 32-fold is still 0.7B parameters, 0.64B of them its 256 experts x 58
blocks): ``experts`` divides their hidden width that much further, which no layout's cut depends on
(experts are split whole over ep, and FSDP cuts them by the expert dim).
"""

from __future__ import annotations

from shardwise.config.schema import ConfigError
from shardwise.models import ModelArgs

KEPT = ("n_layers", "n_heads", "n_kv_heads", "vocab_size")
KEPT_MOE = ("n_experts", "n_shared_experts", "moe_top_k", "n_dense_layers", "moe_n_groups", "moe_topk_groups")
"""What ``--shrink`` keeps (named in its notice): every model's, and an MoE model's too."""


def widths(args: ModelArgs) -> dict[str, int]:
    """The model's hidden widths (field -> its resolved value; latent attention's and the experts'
    where the model has them)."""
    out = {"dim": args.dim, "ffn_hidden_size": args.ffn_hidden_dim}
    if not args.kv_lora_rank:  # (latent attention's heads are its own parts, below)
        out["head_size"] = args.head_size or args.dim // args.n_heads
    for name in ("moe_hidden_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim"):
        if getattr(args, name):
            out[name] = getattr(args, name)
    return out


def _rotated(args: ModelArgs) -> str:
    """The width RoPE rotates in pairs (it must stay even)."""
    return "qk_rope_head_dim" if args.qk_rope_head_dim else "head_size"


def largest_factor(args: ModelArgs) -> int:
    """The largest power of two that divides every width and leaves the rotated width even."""
    w, f = widths(args), 1
    while all(v % (2 * f) == 0 for v in w.values()) and (w[_rotated(args)] // (2 * f)) % 2 == 0:
        f *= 2
    return f


def shrink(args: ModelArgs, factor: int, experts: int = 1) -> tuple[list[str], str]:
    """The model overrides that narrow ``args`` by ``factor`` (its routed experts' hidden width by
    ``factor * experts``), and the notice that says what was kept and what was scaled."""
    w = widths(args)
    if experts != 1:
        if not args.n_experts:
            raise ConfigError("--shrink-experts narrows an MoE model's experts: this model has none")
        if experts < 1 or w["moe_hidden_dim"] % (factor * experts):
            raise ConfigError(f"--shrink-experts {experts} with --shrink {factor} does not divide "
                              f"model.moe_hidden_dim={w['moe_hidden_dim']}: use a smaller power of two")
    if factor < 2:
        raise ConfigError(f"--shrink needs a factor >= 2 (got {factor}); this model's widths allow at most "
                          f"{largest_factor(args)}")
    bad = [n for n, v in w.items() if v % factor]
    if bad or (w[_rotated(args)] // factor) % 2:
        rot = _rotated(args)
        what = f"model.{bad[0]}={w[bad[0]]}" if bad else f"model.{rot}={w[rot]} into an even width"
        raise ConfigError(f"--shrink {factor} does not divide {what}: use a factor of at most "
                          f"{largest_factor(args)} that divides every width")
    new = {n: v // (factor * experts if n == "moe_hidden_dim" else factor) for n, v in w.items()}
    overrides = [f"--model.{n}={v}" for n, v in new.items()]
    kept = ", ".join(f"{n}={getattr(args, n)}" for n in (*KEPT, *(KEPT_MOE if args.n_experts else ())))
    scaled = ", ".join(f"{n} {v} -> {new[n]}" for n, v in w.items())
    return overrides, f"--shrink {factor}: kept {kept}; scaled {scaled}"
