"""What happens to a :class:`~shardwise.config.Config` once it is read: the model preset fills the
unset model fields, values are checked (choices, signs, ranges and the relations between fields
that need no process group; each failure is one line naming the field and the fix), and ``auto``
settings are resolved for the device."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardwise.config import Config, ConfigError, ModelConfig, coerce

_CHOICES = {
    "run.device": ("auto", "cpu", "cuda"),
    "data.txt_sample_by": ("paragraph", "line", "document"),
    "training.mixed_precision": ("bf16", "fp32", "auto"),
    "optimizer.implementation": ("auto", "fused", "foreach", "for-loop"),
    "lr_scheduler.decay": ("cosine", "linear", "wsd", "constant"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "parallel.reshard_after_forward": ("default", "always", "never"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved1f1b", "zbv", "dualpipev"),
    "parallel.fsdp_reduce_dtype": ("fp32", "bf16"),
    "parallel.cp_rotate_method": ("allgather", "alltoall"),
    "metrics.wandb_mode": ("offline", "online"),
    "optimizer.state_dtype": ("fp32", "bf16"),
    "activation_checkpoint.mode": ("none", "full", "selective", "layer"),
    "model.moe_score": ("softmax", "sigmoid"),
    "model.moe_balance": ("aux_loss", "bias", "none"),
    "checkpoint.async_mode": ("none", "thread", "process"),
    "training.nonfinite": ("stop", "skip"),
}

_POSITIVE = ("training.steps", "training.seq_len", "training.global_batch", "metrics.log_interval",
             "eval.steps", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
             "model.vocab_size", "model.multiple_of", "model.max_seq_len", "profile.start",
             "profile.every", "profile.active", "activation_checkpoint.every", "float8.min_dim",
             "debug.trace_step", "data.shard_mb")
_NON_NEGATIVE = ("training.loss_chunk", "training.micro_batch", "training.max_grad_norm", "optimizer.lr",
                 "optimizer.weight_decay", "lr_scheduler.warmup_steps", "checkpoint.interval",
                 "eval.interval", "metrics.peak_tflops", "optimizer.eps",
                 "checkpoint.keep_latest_k", "debug.nan_step", "debug.fail_step", "debug.fail_rank",
                 "data.workers")


def _get(cfg: Config, key: str) -> Any:
    s, _, k = key.partition(".")
    return getattr(getattr(cfg, s), k)


def validate(cfg: Config) -> None:
    """Value checks that need no world size (layout checks live in ParallelDims)."""
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {_get(cfg, key)!r}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)}")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {_get(cfg, key)}")
    for key in ("optimizer.beta1", "optimizer.beta2"):
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {_get(cfg, key)}")
    for key in ("data.val_fraction", "lr_scheduler.min_lr_ratio", "lr_scheduler.decay_fraction"):
        if not 0.0 <= _get(cfg, key) <= 1.0:
            raise ConfigError(f"{key} must be in [0, 1], got {_get(cfg, key)}")
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.head_size:
        if m.head_size % 2:
            raise ConfigError(f"model.head_size={m.head_size} must be even (RoPE rotates pairs)")
    elif m.dim % m.n_heads or (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim={m.dim} must be n_heads={m.n_heads} times an even head dim")
    if cfg.training.seq_len > m.max_seq_len:
        raise ConfigError(f"training.seq_len={cfg.training.seq_len} exceeds model.max_seq_len="
                          f"{m.max_seq_len}: lower the sequence length or raise model.max_seq_len")
    if cfg.profile.warmup < 0 or cfg.profile.warmup + cfg.profile.active > cfg.profile.every:
        raise ConfigError(f"profile.warmup={cfg.profile.warmup} + profile.active={cfg.profile.active} must "
                          f"fit in profile.every={cfg.profile.every} steps (warmup >= 0)")
    if (cfg.debug.comm or cfg.debug.memory) and cfg.debug.trace_step > cfg.training.steps:
        raise ConfigError(f"debug.trace_step={cfg.debug.trace_step} exceeds training.steps="
                          f"{cfg.training.steps}: nothing would be recorded")
    for dim, spec in cfg.parallel.backend_override.items():
        if dim not in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
            raise ConfigError(f"parallel.backend_override names unknown mesh dim '{dim}'; use pp, "
                              "dp_replicate, dp_shard, cp or tp")
        parse_backend_spec(dim, spec)


BACKEND_OPTIONS: dict[str, dict[str, type]] = {
    "gloo": {"timeout_s": float, "threads": int},
    "nccl": {"timeout_s": float, "high_priority": bool},
}


def parse_backend_spec(dim: str, spec: str) -> tuple[str, dict[str, Any]]:
    """``"gloo:timeout_s=600:threads=4"`` -> ``("gloo", {"timeout_s": 600.0, "threads": 4})``."""
    name, *opts = spec.split(":")
    if name not in BACKEND_OPTIONS:
        raise ConfigError(f"parallel.backend_override {dim}={spec!r}: backend must be one of "
                          f"{', '.join(BACKEND_OPTIONS)}")
    parsed: dict[str, Any] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in BACKEND_OPTIONS[name]:
            raise ConfigError(f"parallel.backend_override {dim}: {name} has no option '{key}'; options: "
                              f"{', '.join(BACKEND_OPTIONS[name])}")
        parsed[key] = coerce(f"parallel.backend_override {dim} {key}", BACKEND_OPTIONS[name][key],
                              value, from_cli=True)
    return name, parsed


# Set by `shardwise train --nproc` for its ranks: the folder where a failing rank leaves its one-line
# error for the launcher (shardwise/cli.py), which also marks a process as a launched rank.
LAUNCHED_RANK_ENV = "SHARDWISE_ERROR_DIR"


def notice(text: str) -> None:
    """Tell the user about a value resolved for them, once per run: the process the user started
    speaks (under torchrun, rank 0); ranks started by ``shardwise train --nproc`` stay quiet."""
    if os.environ.get(LAUNCHED_RANK_ENV) or os.environ.get("RANK", "0") != "0":
        return
    print(f"notice: {text}", flush=True)


def clamp_warmup(cfg: Config) -> None:
    """A warmup longer than the run (a 5-step smoke run of a preset with 10 warmup steps) is
    clamped to the run, with a notice, rather than refused."""
    lr, steps = cfg.lr_scheduler, cfg.training.steps
    if lr.warmup_steps > steps:
        notice(f"lr_scheduler.warmup_steps={lr.warmup_steps} is longer than training.steps={steps}: "
               f"warming up over all {steps} steps")
        lr.warmup_steps = steps


def resolve_precision(cfg: Config, device: str | None = None) -> None:
    """Turn ``training.mixed_precision = "auto"`` into bf16 or fp32 for ``device`` (None = local).

    Every rank of a job decides alike: from CPU feature flags, not from a timing."""
    if cfg.training.mixed_precision != "auto":
        return
    from shardwise.parallel.dims import cpu_has_native_bf16, device_type

    device = device or device_type(cfg.run.device)
    fast = device != "cpu" or cpu_has_native_bf16()
    cfg.training.mixed_precision = "bf16" if fast else "fp32"


def resolve_model(cfg: Config) -> None:
    """Fill every unset model field from the named preset, so the saved config is complete."""
    from shardwise.models.presets import PRESETS

    if cfg.model.name not in PRESETS:
        raise ConfigError(f"model.name '{cfg.model.name}' is not a preset; choose one of "
                          f"{', '.join(PRESETS)}")
    preset = PRESETS[cfg.model.name]
    for f in dataclasses.fields(ModelConfig):
        if f.name != "name" and getattr(cfg.model, f.name) is None:
            setattr(cfg.model, f.name, getattr(preset, f.name))
