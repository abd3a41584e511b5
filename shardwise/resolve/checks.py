"""A :class:`~shardwise.config.schema.Config` as read and checked, then as resolved.

:func:`load_config` reads the file and flags, completes the ``[model]`` section (from an HF folder's
config.json, else the preset it names) and checks every value (choices, signs, ranges and the
relations between fields that need no model or process group; each failure one line naming the
field and the fix). It changes nothing else the user wrote. :func:`resolve_config` makes the run's
own copy with what was left to the machine (``auto`` precision, the device) or asked beyond the run
(a warm-up or profiler window past its last step) resolved, each said in a notice;
:func:`shardwise.resolve.run.resolve_run` calls it, and the copy is ``run.cfg``."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import shardwise.runtime.machine
from shardwise.config.lora import check_lora
from shardwise.config.model_args import ModelArgs
from shardwise.config.notice import notice
from shardwise.config.outputs import check_folder
from shardwise.config.schema import Config, ConfigError, MetricsConfig, ModelConfig, read_config
from shardwise.models import check_args, model_args
from shardwise.models.hf_config import (
    args_from_hf,
    hf_tokenizer,
    model_config_of,
    peft_lora_config,
    read_hf_config,
)
from shardwise.models.presets import PRESETS
from shardwise.parallel.dims import parse_backend_spec
from shardwise.runtime.hub import is_hub_id, local_model

_POSITIVE = ("training.steps", "training.seq_len", "training.global_batch", "metrics.log_interval",
             "eval.steps", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
             "model.vocab_size", "model.multiple_of", "model.max_seq_len", "profile.start",
             "profile.every", "profile.active", "activation_checkpoint.every", "float8.min_dim",
             "debug.trace_step", "data.shard_mb", "training.spike_window")
_NON_NEGATIVE = ("training.epochs", "training.loss_chunk", "training.micro_batch", "training.max_grad_norm",
                 "training.stop_after", "optimizer.lr",
                 "optimizer.weight_decay", "lr_scheduler.warmup_steps", "checkpoint.interval",
                 "eval.interval", "metrics.peak_tflops", "optimizer.eps",
                 "checkpoint.keep_latest_k", "debug.nan_step", "debug.spike_step", "debug.fail_step",
                 "debug.fail_rank", "data.workers")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- CLI overrides (:func:`read_config`), the ``[model]`` section completed
    (``checkpoint.initial_hf``'s config.json, else the named preset's values for the unset fields),
    then every value checked. Runs before torch is imported, and changes nothing else: the layout, the
    model's shape and the values resolved for a machine are :func:`~shardwise.resolve.run.resolve_run`'s."""
    cfg = read_config(path, overrides)
    model_from_hf(cfg)
    complete_model(cfg)
    lora_from_adapter(cfg)
    validate(cfg)
    if cfg.optimizer.lr == 0:
        notice("optimizer.lr=0: the weights will not change (forward and backward only); set "
               "optimizer.lr above 0 to train")
    return cfg


def resolve_config(cfg: Config, device: str | None = None) -> Config:
    """The run's own config: ``cfg`` with ``auto`` precision resolved for ``device`` ("cpu" / "cuda";
    None = this machine's, per ``run.device``; the planner passes the device it plans for, which then
    also fills ``run.device=auto``), chat data's document mask on, and a warm-up or profiler window
    past the run's end clamped to it -- each said once in a notice. ``cfg`` itself is not changed;
    it is returned as it is when nothing needs resolving (so resolving twice says nothing twice)."""
    out = copy.copy(cfg)  # (the sections resolved here are copied; the others are shared with cfg)
    for section in ("data", "lr_scheduler", "profile", "training", "run", "metrics"):
        setattr(out, section, copy.copy(getattr(cfg, section)))
    if out.data.format == "chat" and not out.data.document_mask:
        notice("data.format=chat: data.document_mask is on (each conversation attends to itself only)")
        out.data.document_mask = True
    if out.lora.rank and out.float8.enabled:  # (the GPU presets enable it; a LoRA run of them adapts)
        notice("lora: float8 linears take no adapter yet: this run trains without float8 "
               "(float8.enabled=false)")
        out.float8 = dataclasses.replace(out.float8, enabled=False)
    clamp_warmup(out)
    clamp_profile(out)
    resolve_precision(out, device)
    resolve_wandb_mode(out.metrics)
    if device is not None and out.run.device == "auto":
        out.run.device = device
    return cfg if out == cfg else out  # (the planner resolves each candidate of one resolved base)


def _get(cfg: Config, key: str) -> Any:
    s, _, k = key.partition(".")
    return getattr(getattr(cfg, s), k)


def validate(cfg: Config) -> None:
    """Value checks that need no world size (layout checks live in ParallelDims)."""
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
    if cfg.training.spike_factor != 0 and not cfg.training.spike_factor > 1:
        raise ConfigError(f"training.spike_factor must be > 1 (or 0: no spike detection), got "
                          f"{cfg.training.spike_factor}")
    for key in ("data.prepared_dir", "data.cache_dir"):
        if _get(cfg, key):
            check_folder(_get(cfg, key), key)
    check_args(cfg.model)
    check_lora(cfg.lora)
    if cfg.training.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"training.seq_len={cfg.training.seq_len} exceeds model.max_seq_len="
                          f"{cfg.model.max_seq_len}: lower the sequence length or raise model.max_seq_len")
    if cfg.profile.warmup < 0 or cfg.profile.warmup + cfg.profile.active > cfg.profile.every:
        raise ConfigError(f"profile.warmup={cfg.profile.warmup} + profile.active={cfg.profile.active} must "
                          f"fit in profile.every={cfg.profile.every} steps (warmup >= 0)")
    if cfg.training.stop_after > cfg.training.steps:
        raise ConfigError(f"training.stop_after={cfg.training.stop_after} exceeds training.steps="
                          f"{cfg.training.steps}: stop at or before the run's last step (0 = run them all)")
    if (cfg.debug.comm or cfg.debug.memory) and cfg.debug.trace_step > cfg.training.steps:
        raise ConfigError(f"debug.trace_step={cfg.debug.trace_step} exceeds training.steps="
                          f"{cfg.training.steps}: nothing would be recorded")
    if cfg.float8.enabled and cfg.float8.recipe == "rowwise" and cfg.float8.fsdp_all_gather:
        raise ConfigError("float8.recipe=rowwise has no float8 FSDP all-gather (torchao gathers "
                          "tensorwise-scaled weights only): set float8.fsdp_all_gather=false")
    for dim, spec in cfg.parallel.backend_override.items():
        parse_backend_spec(dim, spec)
    check_synthetic(cfg)


def check_synthetic(cfg: Config) -> None:
    """data.synthetic draws its own tokens: a corpus, chat data or epochs beside it are refused."""
    d = cfg.data
    if not d.synthetic:
        return
    given = [name for name, on in (("data.path", d.path), ("data.sources", d.sources),
                                   ("data.val_path", d.val_path), ("data.format=chat", d.format == "chat"),
                                   ("training.epochs", cfg.training.epochs)) if on]
    if given:
        raise ConfigError(f"data.synthetic=true trains on random token ids, not on {given[0]}: drop one "
                          "of the two")


def last_step(cfg: Config) -> int:
    """The step the run ends at: ``training.stop_after`` when set, else ``training.steps``."""
    return cfg.training.stop_after or cfg.training.steps


def clamp_profile(cfg: Config) -> None:
    """A profiler window that would end after the run (``--profile.enabled true`` on a 10-step run
    with the 50-step windows) records the run's last steps instead, with a notice: a trace, not
    silently none."""
    p, steps = cfg.profile, cfg.training.steps
    if not p.enabled or p.start + p.every - 1 <= steps:
        return
    before = f"{p.start + p.every - p.active}-{p.start + p.every - 1}"
    p.active = min(p.active, steps)
    p.warmup = min(p.warmup, steps - p.active)
    p.start = min(p.start, steps - p.warmup - p.active + 1)
    p.every = steps - p.start + 1
    notice(f"profile: the first window would record steps {before}, after training.steps={steps}: "
           f"recording steps {steps - p.active + 1}-{steps} (profile.start={p.start}, profile.every="
           f"{p.every}); set profile.start and profile.every to choose")


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

    Every rank of a job decides alike: from CPU feature flags, not from a timing. bf16 asked for on a
    CPU without bf16 arithmetic is kept, with a notice of how it runs there."""
    machine = shardwise.runtime.machine
    if cfg.training.mixed_precision == "bf16":
        # (not device_type(run.device): a plan for GPUs resolves run.device=cuda on a machine without)
        where = device or cfg.run.device
        if machine.bf16_without_arithmetic(machine.device_type("auto") if where == "auto" else where, "bf16"):
            _bf16_notice(machine.cpu_kind())
    if cfg.training.mixed_precision != "auto":
        return
    device = device or machine.device_type(cfg.run.device)
    fast = device != "cpu" or machine.cpu_has_native_bf16()
    cfg.training.mixed_precision = "bf16" if fast else "fp32"


@functools.cache
def _bf16_notice(kind: str) -> None:
    """The notice for bf16 on a CPU without bf16 arithmetic: once per process (a plan or verify
    resolves many runs)."""
    notice(f"training.mixed_precision=bf16 on a CPU without bf16 arithmetic ({kind}): its GEMMs and "
           "attention run in fp32 on the bf16 values, rounded once to bf16 as a bf16 kernel's are "
           "(shardwise.ops.cpu_bf16), about as fast as fp32, which auto picks here (more precise)")


def wandb_logged_in() -> bool:
    """Whether W&B has this user's key without asking the network: WANDB_API_KEY, or the netrc entry
    ``wandb login`` writes (``NETRC`` or ~/.netrc) for the W&B host (WANDB_BASE_URL)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(m: MetricsConfig) -> None:
    """metrics.wandb_mode=auto: online when logged in, else offline with a notice; left ``auto`` when
    W&B's own WANDB_MODE is set (W&B then reads it)."""
    if not m.wandb or m.wandb_mode != "auto" or os.environ.get("WANDB_MODE"):
        return
    if wandb_logged_in():
        m.wandb_mode = "online"
        return
    notice("metrics.wandb: not logged in to W&B (`wandb login` or WANDB_API_KEY), so the run logs offline "
           "into run.dir/wandb; upload it later with `wandb sync RUN_DIR/wandb/offline-run-*`")
    m.wandb_mode = "offline"


def model_from_hf(cfg: Config) -> None:
    """checkpoint.initial_hf: the [model] section from the folder's config.json (the shape its weights
    have), and its tokenizer.json unless data.tokenizer names one."""
    ref = cfg.checkpoint.initial_hf
    if not ref:
        return
    if cfg.checkpoint.path:
        raise ConfigError("checkpoint.initial_hf and checkpoint.path both name starting weights: keep one")
    folder = local_model(ref, "checkpoint.initial_hf")  # a Hub id: its snapshot, fetched once
    hf = read_hf_config(folder)
    args = args_from_hf(hf)
    if cfg.model.name in PRESETS and model_args(cfg.model) != args:
        notice(f"checkpoint.initial_hf: the model is {ref}'s (its config.json), not the [model] "
               f"section's ({cfg.model.name})")
    model = model_config_of(args)
    cfg.model = model
    # The model's own tokenizer, named as the user named the model (an id resolves again where read).
    own = hf_tokenizer(folder)
    cfg.data.tokenizer = cfg.data.tokenizer or (ref if own and is_hub_id(ref) else own)
    if cfg.optimizer.lr >= PRETRAINING_LR and not cfg.lora.rank and not cfg.checkpoint.initial_adapter:
        preset = SFT_PRESETS.get(str(hf.get("model_type")), "sft-llama3")
        notice(f"checkpoint.initial_hf starts from trained weights, but optimizer.lr={cfg.optimizer.lr:g} is "
               f"a pretraining rate (fine-tuning uses about 1e-5): --config configs/{preset}.toml sets the "
               "fine-tuning recipe (learning rate, warm-up, sequence length, epochs)")


PRETRAINING_LR = 1e-4
"""A learning rate at or above this, with pretrained weights, earns the fine-tuning notice."""
SFT_PRESETS = {"qwen3": "sft-qwen3", "qwen3_moe": "sft-qwen3", "llama": "sft-llama3",
               "deepseek_v3": "sft-deepseek-v3"}
"""The fine-tuning preset of each HF family (configs/)."""


def lora_from_adapter(cfg: Config) -> None:
    """checkpoint.initial_adapter: the ``[lora]`` the PEFT folder was trained with; with lora.rank
    unset it becomes the run's (said in a notice), set it must agree (one line naming the field)."""
    if not (ref := cfg.checkpoint.initial_adapter):
        return
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"checkpoint.initial_adapter '{ref}' is not a folder: point it at a PEFT adapter "
                          "folder (adapter_config.json + adapter_model.safetensors)")
    theirs = peft_lora_config(folder, model_args(cfg.model), "checkpoint.initial_adapter")
    if not cfg.lora.rank:
        cfg.lora = dataclasses.replace(cfg.lora, **theirs)
        notice(f"checkpoint.initial_adapter: LoRA r={theirs['rank']} alpha={theirs['alpha']:g} on "
               f"{theirs['targets']}, as {folder / 'adapter_config.json'} says")
        return
    for name in ("rank", "alpha", "targets"):
        mine = getattr(cfg.lora, name)
        if name == "targets" and mine == "all-linear":
            continue  # (all-linear resolves on the model: the adapter's own list is what loads)
        if mine != theirs[name]:
            raise ConfigError(f"checkpoint.initial_adapter was trained with lora.{name}={theirs[name]}, this "
                              f"run has lora.{name}={mine}: pass --lora.{name}={theirs[name]} (or leave "
                              "lora.rank unset to take the adapter's)")


def complete_model(cfg: Config) -> None:
    """Fill every unset model field from the named preset, so the saved config is complete."""
    if cfg.model.name and cfg.model.name not in PRESETS:
        raise ConfigError(f"model.name '{cfg.model.name}' is not a preset; choose one of "
                          f"{', '.join(PRESETS)}, or \"\" to give every field in [model]")
    preset = PRESETS[cfg.model.name] if cfg.model.name else ModelArgs()
    for f in dataclasses.fields(ModelConfig):
        if f.name != "name" and getattr(cfg.model, f.name) is None:
            setattr(cfg.model, f.name, getattr(preset, f.name))
