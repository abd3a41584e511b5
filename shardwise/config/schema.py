"""Typed configuration: dataclass sections, TOML presets, ``--section.key=value`` overrides.

Each field's docstring (the string literal under it) is its help text (``shardwise train --help-config``).
Every value is checked against its field's type when it is read, so a mistyped key or a wrong type
fails with one line that names the key, before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import tomli_w

from shardwise.config.debug import DebugConfig
from shardwise.config.lora import LoRAConfig
from shardwise.config.model_args import ModelArgs
from shardwise.config.types import ConfigError, coerce, read_toml, type_name

__all__ = ["ConfigError", "DebugConfig", "LoRAConfig", "coerce", "type_name"]  # re-exported: the package
# imports them from here


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory: resolved config.toml, metrics.jsonl, tb/, loss.png and checkpoints/ go here."""
    overwrite: bool = False
    """Start over in a run.dir holding an earlier run: delete what its runs wrote there (as its
    .shardwise-record lists) but the checkpoint.path checkpoint; your own files stay."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type: auto (cuda when available, else cpu), cpu or cuda."""
    cpu_memory_cache: bool = True
    """CPU: glibc malloc keeps freed memory for reuse (no mmap and page faults per large tensor
    each step; the resident size stays at the step's peak); false = the C library's defaults."""


def _preset_overrides() -> type:
    """The ``[model]`` section, derived from :class:`ModelArgs` so the field list exists once:
    ``name`` picks the preset, and each model field set here (None = the preset's) overrides it."""
    hints = typing.get_type_hints(ModelArgs)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default="debug"))]
    fields += [(f.name, hints[f.name] | None, field(default=None)) for f in dataclasses.fields(ModelArgs)]
    return dataclasses.make_dataclass("ModelConfig", fields, namespace={
        "__module__": __name__, "docs_from": ModelArgs,
        "name_doc": "Model preset (see shardwise/models/presets.py); the fields below override it when "
                    "set. \"\" = no preset: the fields below, unset ones at their defaults (an imported "
                    "Hugging Face model's TOML)."})


ModelConfig = _preset_overrides()


def model_label(model: Any) -> str:
    """A [model] section's name in messages: its preset, or "custom" (no preset)."""
    return model.name or "custom"


@dataclass
class DataConfig:
    path: str = ""
    """Training text: a .txt/.jsonl/.json/.parquet file or a folder of them; empty = the shipped KJV
    corpus (data.format=chat: the shipped chat set made from it)."""
    tokenizer: str = ""
    """A tokenizer.json or a Hugging Face tokenizer folder (tokenizer.json with tokenizer_config.json:
    its bos/eos/pad tokens and chat template), 'byte' for the byte-level fallback, or empty = the
    shipped BPE (with a chat template)."""
    text_field: str = "text"
    """Column holding the text in .jsonl/.json/.parquet data."""
    format: Literal["text", "chat"] = "text"
    """text: each row's data.text_field is a document; chat: each row's data.messages_field is a
    conversation, rendered with the tokenizer's chat template, the loss on assistant tokens only,
    each conversation its own document (data.document_mask is then on)."""
    messages_field: str = "messages"
    """Column holding the conversation (a list of {role, content}) when data.format=chat."""
    txt_sample_by: Literal["paragraph", "line", "document"] = "paragraph"
    """How .txt files split into documents: paragraph (blank lines), line, or document (whole file)."""
    val_fraction: float = 0.02
    """Fraction of documents held out for the validation loss."""
    document_mask: bool = False
    """Mask attention across document boundaries inside a packed sequence."""
    cache_dir: str = "~/.cache/shardwise"
    """Where prepared corpora go when data.prepared_dir is empty (and the measured CPU peak)."""
    sources: list[dict[str, Any]] = field(default_factory=list)
    """A mix of corpora instead of data.path: [[data.sources]] tables with path and weight (name and
    text_field optional); on the command line 'path=a.jsonl,weight=0.7;path=b,weight=0.3'."""
    val_path: str = ""
    """Held-out text of its own (same kinds as data.path); empty = data.val_fraction of each source."""
    prepared_dir: str = ""
    """Prepared token shards (what `shardwise prepare` writes and training memory-maps); empty = a
    folder under data.cache_dir named by the source files, the tokenizer and these settings."""
    workers: int = 0
    """Processes that tokenize during preparation; 0 = every usable core."""
    shard_mb: float = 64.0
    """Source text per prepared shard in MB: the unit of parallel work and of resumed preparation."""
    skip_bad_rows: bool = False
    """Skip (and count) rows that cannot be read -- bad JSON or UTF-8, a missing or non-string text
    field -- instead of stopping at the first with its file and row."""
    synthetic: bool = False
    """Train on seeded random token ids over all of the model's vocabulary: no corpus, no tokenizer
    (step-time runs; ``verify`` of a family's preset without its tokenizer). See docs/data.md."""


@dataclass
class TrainingConfig:
    steps: int = 100
    """Optimizer steps of the run and its schedule (derived from training.epochs when that is set)."""
    stop_after: int = 0
    """End after this step as if it were the last, on training.steps' schedule; 0 = run every step."""
    epochs: float = 0.0
    """Passes over the prepared training windows; > 0 sets training.steps to ceil(epochs * windows /
    global_batch), with a notice (windows: of all sources; chat data its packed windows). 0 = off."""
    seed: int = 42
    """Seed for weight init, data order and every RNG."""
    seq_len: int = 512
    """Tokens per sequence."""
    global_batch: int = 8
    """Sequences per optimizer step, summed over data-parallel ranks and micro-batches."""
    micro_batch: int = 0
    """Sequences per rank per forward/backward; 0 = global_batch / dp (no accumulation)."""
    mixed_precision: Literal["bf16", "fp32", "auto"] = "auto"
    """Compute dtype in forward/backward (master weights stay fp32): bf16, fp32, or auto = bf16 on
    GPUs and CPUs with bf16 arithmetic (AMX, AVX512-BF16, Arm BF16), else fp32; resolved at load."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is still reported)."""
    loss: Literal["auto", "fused", "plain"] = "auto"
    """Output projection + cross-entropy. fused: over chunks of tokens, the gradients computed in
    the same pass (the full logits never exist; no recompute); plain: logits, then cross-entropy;
    auto: fused, but plain under pipeline parallel (its schedule takes the last stage's logits) and
    tensor parallel (there the vocab-parallel fused op recomputes the logits: a memory saving)."""
    loss_chunk: int = 0
    """Tokens per chunk of the fused loss; 0 = sized from the vocabulary (2^25 logits a chunk:
    1,048 tokens at a 32,000 vocabulary, 261 at 128,256) but at most 4 chunks per micro-batch
    unless that takes over 2^28 logits a chunk, split into equal chunks."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """NaN/inf gradient norm: stop (exit 2 before the update, the last checkpoint stays the last good
    state) or skip (drop the update; metrics count skipped_steps)."""
    spike: Literal["warn", "skip"] = "warn"
    """A loss above spike_factor x the mean of the spike_window healthy steps before (after warm-up):
    warn (a notice naming its data windows, marked in the logs) or skip (also drop its update)."""
    spike_factor: float = 1.3
    """The margin of training.spike (> 1); 0 = no detection."""
    spike_window: int = 10
    """Steps training.spike averages over (refilled after a resume)."""


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not norms)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW kernel: auto (fused where supported), fused, foreach or for-loop (fp32 states only)."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """AdamW moment storage: fp32, or bf16 (half the bytes; updates still computed in fp32)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 10
    """Linear warmup from 0 to the peak learning rate."""
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """After warmup: cosine, linear, wsd (warmup-stable-decay) or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = 0.2
    """wsd only: fraction of all steps spent in the final linear decay."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer dim: gradients all-reduced, parameters replicated)."""
    dp_shard: int = -1
    """FSDP degree (parameters sharded); -1 takes whatever the other degrees leave of the world."""
    tp: int = 1
    """Tensor-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (ring attention)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE models; borrows its ranks from dp_shard*cp*tp)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "zbv", "dualpipev"] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved1f1b, zbv or dualpipev (over the micro-batches)."""
    pp_stages_per_rank: int = 2
    """interleaved1f1b: stages per rank (zbv and dualpipev always use 2, gpipe and 1f1b 1)."""
    loss_parallel: bool = True
    """With tp > 1: keep logits vocab-sharded and compute the cross-entropy without gathering them."""
    async_tp: bool = False
    """With tp > 1 on CUDA/NCCL and compile: torch's micro-pipelined TP over symmetric memory (the
    all-gather and reduce-scatter split into chunks that overlap the matmuls; an inductor pass).
    Written, not yet run on a GPU; refused on CPU/gloo."""
    cp_load_balance: bool = True
    """With cp > 1: each rank gets a head and a tail chunk, so causal attention work is even."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """With cp > 1: how key/value shards travel around the ring: allgather or alltoall."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto (nccl on cuda with gloo for cpu tensors, gloo on cpu), gloo, nccl."""
    backend_override: dict[str, str] = field(default_factory=dict)
    """Per mesh dim backend[:option=value...], e.g. dp_replicate=gloo:timeout_s=600:threads=4,tp=nccl
    (gloo: timeout_s, threads; nccl: timeout_s, high_priority)."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP: free gathered parameters after forward: default (all but the root), always, never."""
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Gradient reduce-scatter dtype under bf16 mixed precision: fp32 or bf16."""
    one_rank: Literal["auto", "fsdp", "plain"] = "auto"
    """One rank: ``plain`` trains without FSDP (fp32 parameters and gradients, bf16 autocast); ``fsdp``
    wraps it in FSDP2 on a one-rank mesh; auto: plain on a GPU, fsdp on a CPU (fsdp.py plain_rank)."""
    expert_load: float = 1.0
    """estimate and plan: the busiest expert's routed tokens over the mean (metrics.jsonl's expert_load)
    that expert parallel's busiest rank is costed with; 1.0 = balanced routing. Training ignores it."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective", "selective_half", "layer"] = "none"
    """none; full (each block recomputed in backward); selective (keep matmul, attention and
    collective outputs, recompute the elementwise ops); selective_half (as selective, but of each
    block's linear-layer matmuls keep only the 1st, 3rd, 5th, ... and recompute the others: less
    memory than selective for about a third of the block's linear FLOPs again -- torchtitan's
    per-op policy); layer (every `every`-th block in full)."""
    every: int = 2
    """layer mode: checkpoint one block in this many (2 = blocks 0, 2, 4, ...)."""


@dataclass
class CompileConfig:
    enabled: Literal["auto", True, False] = "auto"
    """torch.compile each transformer block and the loss (the first step pays the compile). ``auto``
    compiles a run of at least ``resolve.COMPILE_MIN_STEPS`` steps on the layouts the test suite
    runs compiled (data parallel, FSDP, TP: not PP, CP or EP) where the toolchain is there (a C++
    compiler on CPU, triton on CUDA), and says why when it does not."""


@dataclass
class Float8Config:
    enabled: bool = False
    """Linear GEMMs in float8 with per-tensor current scaling (torchao): E4M3 weights and
    activations, E5M2 output gradients. The output head stays in high precision."""
    min_dim: int = 64
    """Linears with (local) in/out features below this (or not multiples of 16) stay high precision."""
    fsdp_all_gather: bool = False
    """FSDP all-gathers weights already cast to float8 (scales from one all-reduce per step)."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling: one scale per tensor, or one per row (torchao's rowwise recipe: inputs, weights and
    output gradients in E4M3 with power-of-2 scales per row; more accurate, CUDA needs SM90+ for its
    rowwise _scaled_mm). Rowwise has no float8 FSDP all-gather."""


@dataclass
class CheckpointConfig:
    interval: int = 500
    """Save every N steps (0 = only the final save)."""
    final: bool = True
    """Save at the end of training."""
    resume: bool = False
    """Continue the run in run.dir from checkpoint.path, else its newest checkpoint that verifies
    (none verifying: an error; none at all: step 1); metrics.jsonl is appended to."""
    path: str = ""
    """Load this checkpoint (any layout; a weights-only one starts at step 0)."""
    save_initial: bool = False
    """Save the initialized state as step-0 before training (a seed checkpoint for other layouts)."""
    keep_latest_k: int = 0
    """Keep only the newest K committed checkpoints (older ones are deleted after each save); 0 = all."""
    async_mode: Literal["none", "thread", "process"] = "none"
    """none (training waits), thread or process (training goes on once the state is in host memory)."""
    verify_checksums: bool = True
    """Check every file's SHA-256 against the manifest before loading (sizes are always checked)."""
    initial_hf: str = ""
    """Start from a Hugging Face folder's weights (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3, block-scaled fp8
    included; any layout): its config.json gives the [model] section, its tokenizer.json the tokenizer
    unless data.tokenizer is set. Each rank reads the full tensor of each of its own parameters, one at
    a time, and keeps its shard (no copy on disk); a resume goes on from the run's own checkpoints."""
    initial_adapter: str = ""
    """Start the LoRA adapters from a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors),
    on the base that initial_hf or path names; its settings become [lora] unless lora.rank is set
    (then they must agree)."""
    export_hf: bool = False
    """Also write each saved checkpoint as a Hugging Face folder (bf16) in run.dir/hf/step-<N>
    (rank 0 gathers the model in host memory; keep_latest_k removes it with its checkpoint)."""


@dataclass
class MetricsConfig:
    log_interval: int = 1
    """Log metrics every N steps (the loss all-reduce and .item() sync happen only then)."""
    tensorboard: bool = True
    """Write a TensorBoard log to run.dir/tb."""
    plot: bool = True
    """Write run.dir/loss.png at the end."""
    log_format: Literal["auto", "bar", "line", "json"] = "auto"
    """What rank 0 prints each log interval: bar (a progress bar), line (one line: time of day,
    step/total, loss, lr, grad norm, tokens/s per device, MFU, peak memory, ETA), json (the same as one
    JSON object per line); auto = bar on a terminal, line when output goes to a file (Slurm, nohup)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device for MFU; 0 = from the GPU table, or measured on CPU and cached."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`), into run.dir/wandb."""
    wandb_project: str = "shardwise"
    """W&B project name."""
    wandb_mode: Literal["auto", "offline", "online"] = "auto"
    """auto = online when logged in (`wandb login`, WANDB_API_KEY), else offline (a notice says so)."""
    mlflow: str = ""
    """Also log to MLflow at this tracking URI (sqlite:///runs/mlflow.db, http://HOST:5000, databricks)."""


@dataclass
class EvalConfig:
    interval: int = 50
    """Run the validation loss every N steps and at the end (0 disables)."""
    steps: int = 4
    """Validation batches of global_batch sequences (capped by the size of the held-out split)."""


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Record torch.profiler traces to run.dir/traces/rank{R}_step{S}.json (Perfetto / chrome://tracing)."""
    start: int = 1
    """First step of the first profiling window."""
    every: int = 50
    """Window length in steps; each window records its last `active` steps after `warmup` more."""
    warmup: int = 1
    """Profiled-but-discarded steps before the recorded ones (the profiler's own start-up)."""
    active: int = 2
    """Steps recorded per window."""
    record_shapes: bool = False
    """Record operator input shapes."""
    profile_memory: bool = False
    """Record tensor allocations in the trace (on CUDA an allocator snapshot is always dumped)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict, None values dropped (TOML has no null)."""
        return {s: {k: v for k, v in dataclasses.asdict(getattr(self, s)).items() if v is not None}
                for s in sections()}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


@functools.cache  # (resolving annotations costs ~0.4 ms a class, and every key of a config asks)
def sections() -> MappingProxyType[str, type]:
    """Config section name -> its dataclass."""
    hints = typing.get_type_hints(Config)
    return MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(Config)})


@functools.cache
def section_fields(section_cls: type) -> MappingProxyType[str, Any]:
    """Field name -> resolved type annotation of one section dataclass."""
    hints = typing.get_type_hints(section_cls)
    return MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(section_cls)})


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{near[0]}'?" if near else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key '{key}'{where}{hint}")


def _apply(cfg: Config, key: str, value: Any, from_cli: bool, where: str) -> None:
    section, _, name = key.partition(".")
    known = sections()
    fields = section_fields(known[section]) if section in known else {}
    if name not in fields:
        raise _unknown(key, [f"{s}.{k}" for s, c in known.items() for k in section_fields(c)], where)
    try:
        value = coerce(key, fields[name], value, from_cli)
    except ConfigError as e:
        raise ConfigError(f"{e}{where}") from None
    setattr(getattr(cfg, section), name, value)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``['--a.b=1', '--c.d', '2', '--e.flag']`` -> ``[('a.b', '1'), ('c.d', '2'), ('e.flag', 'true')]``
    (a boolean key alone means true)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}': overrides take the form --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                if _is_bool(key):
                    out.append((key, "true"))
                    i += 1
                    continue
                raise ConfigError(f"override '--{key}' has no value: use --{key}=VALUE")
            value = args[i + 1]
            i += 1
        out.append((key, value))
        i += 1
    return out


def _is_bool(key: str) -> bool:
    """Whether config key ``key`` (section.name) takes a boolean (``compile.enabled``'s auto too)."""
    section, _, name = key.partition(".")
    cls = sections().get(section)
    tp = section_fields(cls).get(name) if cls is not None else None
    return tp is bool or True in typing.get_args(tp)


def choices(key: str) -> tuple[str, ...]:
    """The values a ``Literal`` field such as ``"parallel.pp_schedule"`` accepts."""
    section, _, name = key.partition(".")
    return typing.get_args(section_fields(sections()[section])[name])


PRESET_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # (package data; ./configs links here)
"""The shipped TOML of each model people run (``configs/<preset>.toml``), beside the package."""


def preset_toml(name: str) -> Path | None:
    """``configs/<name>.toml``: the preset's published training shape, when it exists."""
    path = PRESET_CONFIGS / f"{name}.toml"
    return path if name and path.is_file() else None


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- CLI overrides, each value checked against its field's type (the
    rest -- preset, relations between fields, ``auto`` -- is :func:`shardwise.resolve.checks.load_config`)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file '{p}' is a directory: pass --config with a TOML file in it "
                              "(e.g. configs/debug.toml)")
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist: pass --config with a TOML file "
                              "(e.g. configs/debug.toml)")
        for section, table in read_toml(p, "config file").items():
            if not isinstance(table, dict):
                raise ConfigError(f"config file '{p}': top-level key '{section}' must be a [section]")
            for name, value in table.items():
                _apply(cfg, f"{section}.{name}", value, from_cli=False, where=f" in {p}")
    for key, value in parse_overrides(overrides or []):
        _apply(cfg, key, value, from_cli=True, where=" on the command line")
    return cfg
