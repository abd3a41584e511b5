"""shardwise from Python: the commands as calls that return objects, for notebooks and scripts.

    import shardwise
    run = shardwise.train("configs/debug.toml", training={"steps": 20}, run={"dir": "runs/nb"})
    run.metrics[-1]["loss"]                      # what metrics.jsonl logged, step by step
    model = shardwise.load(run.dir)              # a run (its latest checkpoint), an HF folder, a Hub id
    model.generate("In the beginning")
    model.generate([{"role": "user", "content": "Who made the light?"}])   # on its chat template
    best = shardwise.plan(model="8b", nproc=64, hardware="h100").best   # the planner's best layout
    v = shardwise.verify("configs/debug.toml", ranks=64, layouts=["pp=2,dp_shard=4,tp=8"], steps=2)
    v.passed, v.results[0].loss_rel                                    # every layout vs one rank
    shardwise.estimate(model="8b", nproc=8, parallel={"tp": 2}).peak   # one layout's per-rank bytes
    shardwise.eval(run.dir).loss                                       # held-out loss of its latest step
    shardwise.prepare("configs/debug.toml", data={"path": "corpus/"})  # each source's shards and tokens
    shardwise.convert(to_hf=run.dir, out="hf-out").files               # or from_hf=..., out="ckpt/x"
    shardwise.download("Qwen/Qwen3-0.6B").folder                       # into the Hugging Face cache

Each call runs what the command runs, in this process (``nproc`` local ranks for ``train``), and
speaks through the ``shardwise`` logger (shardwise/config/notice.py): set its level to silence it.
A bad value raises :class:`ConfigError` with the command line's one-line message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.config.schema import ConfigError, read_config

__all__ = ["ConfigError", "Converted", "Downloaded", "Evaluation", "Model", "Plan", "Prepared", "Run",
           "convert", "download", "estimate", "eval", "load", "plan", "prepare", "train", "verify"]


@dataclass(frozen=True)
class Run:
    """A training run's directory, and what it holds."""

    dir: Path

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Each logged step's record (metrics.jsonl): loss, learning rate, grad norm, tokens/s, ..."""
        from shardwise.observe.metrics import read_metrics

        return read_metrics(self.dir / "metrics.jsonl")

    @property
    def checkpoint(self) -> Path | None:
        """The latest checkpoint the run saved (None: none yet)."""
        from shardwise.checkpoint import checkpoint_or_latest

        try:
            return checkpoint_or_latest(self.dir)
        except ConfigError:
            return None


def _flags(sections: dict[str, Any]) -> list[str]:
    """``training={"steps": 20}`` -> ``["--training.steps=20"]``."""
    out: list[str] = []
    for section, values in sections.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{section}={values!r}: give a config section as a dict of its fields, e.g. "
                              "training={'steps': 20}")
        for key, value in values.items():
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"--{section}.{key}={text}")
    return out


def train(config: str | Path | None = None, *, nproc: int | None = None, **sections: Any) -> Run:
    """``shardwise train``: ``config`` (a TOML file; None: the built-in defaults) with each section's
    fields as a dict (``training={"steps": 20}``, ``run={"dir": "runs/nb", "overwrite": True}``), or
    ``model="NAME"`` for a preset (its ``configs/NAME.toml`` when no ``config`` is given, as
    ``--model NAME`` does); ``nproc`` local ranks. Returns the :class:`Run` when training ends."""
    from shardwise.cli import main
    from shardwise.config.schema import preset_toml

    preset = sections.pop("model") if isinstance(sections.get("model"), str) else None
    overrides = _flags(sections)
    if preset is not None:
        overrides.insert(0, f"--model.name={preset}")
        config = config if config is not None else preset_toml(preset)
    path = str(config) if config is not None else None
    argv = ["train", *(["--config", path] if path else []),
            *(["--nproc", str(nproc)] if nproc is not None else []), *overrides]
    code = main(argv, raise_errors=True)
    if code:
        raise RuntimeError(f"shardwise train ended with exit code {code} (its messages say why)")
    return Run(Path(read_config(path, overrides).run.dir))


@dataclass
class Model:
    """A loaded model with its tokenizer (:func:`load`), to generate with."""

    module: Any  # the torch module
    tokenizer: Any
    source: str
    _stop: set[int] = field(repr=False, default_factory=set)

    def generate(self, prompt: str | list[dict[str, str]], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> str:
        """The text the model adds after ``prompt`` (text to continue, or a list of {role, content}
        messages rendered by the chat template), greedy by default, as ``shardwise generate``."""
        from shardwise.infer.generate import Sampling, generate, prompt_ids

        s = Sampling(max_new_tokens, temperature, top_k, top_p, seed)
        s.check()
        messages = prompt if isinstance(prompt, list) else None
        ids = prompt_ids(self.tokenizer, "" if messages is not None else prompt, messages)
        out = generate(self.module, ids, s, self._stop)
        return self.tokenizer.decode([t for t in out if t not in self._stop])


def load(source: str | Path, *, tokenizer: str = "", device: str = "auto", dtype: str = "auto",
         adapter: str | Path = "") -> Model:
    """A checkpoint (a ``step-<N>`` folder, or a run directory: its latest), a Hugging Face folder or
    a Hub id (``ORG/NAME``; ``adapter``: with a PEFT LoRA folder on it), loaded to generate with, as
    ``shardwise generate`` loads it."""
    from shardwise.infer.generate import load_for_generation
    from shardwise.runtime.hub import is_hub_id

    path = Path(source)
    folder = (path / "config.json").is_file() and not (path / "manifest.json").is_file()
    hf = is_hub_id(str(source)) or (folder and not (path / "checkpoints").is_dir())
    if not hf and not path.exists():
        raise ConfigError(f"load: '{source}' is neither a checkpoint, a run directory, a Hugging Face folder "
                          "nor a Hub id (ORG/NAME)")
    loaded = load_for_generation(checkpoint="" if hf else str(path), hf=str(source) if hf else "",
                                 tokenizer=tokenizer, device=device, dtype=dtype, adapter=str(adapter or ""))
    return Model(loaded.model, loaded.tokenizer, loaded.source, loaded.stop)


@dataclass(frozen=True)
class Plan:
    """What ``shardwise plan`` found: the best layouts, each fully estimated, best first."""

    estimates: list[Any]
    """shardwise.plan.estimate.Estimate per layout: ``.layout``, ``.tokens_per_s_per_device``,
    ``.peak`` (bytes), ``.time`` (the step's parts), ``.memory`` (per pipeline rank)."""
    considered: int
    feasible: int
    table: str
    """The table ``shardwise plan`` prints."""
    why_nothing: str
    """When no layout fits: the one line saying why and what would fit ('' otherwise)."""
    _planning: Any = field(repr=False, default=None)

    @property
    def best(self) -> Any | None:
        """The best layout's estimate (None when nothing fits)."""
        return self.estimates[0] if self.estimates else None

    def write(self, path: str | Path, overwrite: bool = False) -> str:
        """The best layout as a ready-to-run config at ``path`` (as ``plan --out``; an existing file is
        refused unless ``overwrite``). Returns the command that launches it."""
        from shardwise.config.notice import notice
        from shardwise.config.outputs import target
        from shardwise.plan.search import layout_toml, run_command

        if self.best is None:
            raise ConfigError(f"plan: nothing to write; {self.why_nothing}")
        try:
            where = target(str(path), "Plan.write", overwrite, folder=False, example="plan.toml")
        except ConfigError as e:  # (the command line's words for the flag)
            raise ConfigError(str(e).replace("pass --overwrite", "pass overwrite=True")) from None
        if said := where.write(layout_toml(self.best, str(path), self._planning.notes)):
            notice(said)
        return run_command(str(path), self._planning.gpus, self._planning.hw)


def plan(config: str | Path | None = None, *, nproc: int, model: str | dict[str, Any] = "",
         hardware: str = "h100", seq: int = 0, global_batch_tokens: str = "", top: int = 5,
         **sections: Any) -> Plan:
    """``shardwise plan``: rank the layouts of ``config`` (or the ``model`` preset) on ``nproc``
    devices of ``hardware``, with each section's fields as a dict as in :func:`train` (``model`` a
    dict: the [model] section's fields). Returns the :class:`Plan`; nothing is written unless
    ``Plan.write``."""
    from shardwise.cli import parse
    from shardwise.config.notice import notice

    if isinstance(model, dict):
        sections, model = {"model": model, **sections}, ""

    argv = ["plan", *(["--config", str(config)] if config is not None else []),
            *(["--model", model] if model else []), "--nproc", str(nproc), "--hardware", hardware,
            "--seq", str(seq), "--global-batch-tokens", global_batch_tokens, "--top", str(top),
            "--out", "", *_flags(sections)]
    command, args, rest = parse(argv)
    planning = command.checked_planning(args, rest)
    result = planning.search()
    for n in planning.notes:
        notice(n)
    return Plan(list(result.top), result.considered, len(result.ranked), planning.table(result),
                "" if result.top else planning.why_nothing(result), planning)


def verify(config: str | Path | None = None, *, layouts: list[str] | None = None, nproc: int | None = None,
           ranks: int | None = None, steps: int = 20, shrink: bool | int = False, shrink_experts: int = 1,
           localize: bool = False, moe_routing: str = "replay", out: str | Path = "runs/verify",
           **sections: Any) -> Any:  # noqa: ANN401 - a shardwise.verify.parity.Verification
    """``shardwise verify``: the one-rank reference and each of ``layouts`` (degree lists such as
    ``"tp=2,dp_shard=2"``) trained ``steps`` steps from one seed and compared, as real local ranks
    (``nproc``) or simulated ones in this process (``ranks``); ``shrink`` narrows the model (True: the
    largest power of two, or N-fold), ``localize`` names where every layout departs, and each
    section's fields are given as a dict as in :func:`train` (``model="NAME"``: a preset). Returns the
    ``Verification``: ``.passed``, ``.results`` (per layout: ``loss_rel``, ``param_rel``,
    ``passed``), ``.tolerance`` and ``.out``; the table is printed as the command prints it."""
    argv = ["verify", *_preset(config, sections),
            *(["--layouts", *layouts] if layouts else []), *(["--nproc", str(nproc)] if nproc else []),
            *(["--ranks", str(ranks)] if ranks is not None else []), "--steps", str(steps),
            *(["--shrink", *([] if shrink is True else [str(shrink)])] if shrink else []),
            "--shrink-experts", str(shrink_experts), *(["--localize"] if localize else []),
            "--moe-routing", moe_routing, "--out", str(out), *_flags(sections)]
    command, args, rest = _parsed(argv)
    return command.verification(args, rest)


def _parsed(argv: list[str]) -> tuple[Any, Any, list[str]]:
    """``argv`` parsed as the command line parses it, its preset's notice said."""
    from shardwise.cli import parse
    from shardwise.config.notice import notice

    command, args, rest = parse(argv)
    if args.model_note:
        notice(args.model_note)
    return command, args, rest


def _preset(config: str | Path | None, sections: dict[str, Any]) -> list[str]:
    """``--config`` and ``--model NAME`` (``model="NAME"`` among the sections) as flags."""
    preset = sections.pop("model") if isinstance(sections.get("model"), str) else None
    return [*(["--config", str(config)] if config is not None else []),
            *(["--model", preset] if preset else [])]


def estimate(config: str | Path | None = None, *, nproc: int, hardware: str = "h100",
             **sections: Any) -> Any:  # noqa: ANN401 - a shardwise.plan.estimate.Estimate
    """``shardwise estimate``: one layout of ``config`` (or ``model="NAME"``, a preset) on ``nproc``
    devices of ``hardware``, each section's fields as a dict as in :func:`train` (the layout in
    ``parallel={...}``). Returns the ``Estimate``: ``.states`` and ``.memory`` per pipeline rank
    (bytes), ``.collectives``, ``.time``, ``.peak``, ``.fits``, ``.mfu``."""
    head = _preset(config, sections)
    command, args, rest = _parsed(["estimate", *head, "--nproc", str(nproc), "--hardware", hardware,
                                   *_flags(sections)])
    return command.estimation(args, rest)


@dataclass(frozen=True)
class Evaluation:
    """What ``shardwise eval`` scored: per data source (and ``"all"``, token-weighted) or per
    lm-evaluation-harness task."""

    checkpoint: Path
    scores: dict[str, Any]
    """Source name -> its Score (``.loss``, ``.perplexity``, ``.tokens``, ``.sequences``); ``"all"``
    is the whole set. Empty with ``tasks``."""
    tasks: dict[str, dict[str, Any]]
    """Task -> the harness's metrics (``tasks=``); empty otherwise."""
    split: str = ""
    seq_len: int = 0

    @property
    def loss(self) -> float:
        """The whole set's mean token loss."""
        return self.scores["all"].loss


def eval(checkpoint: str | Path, *, config: str | Path | None = None, split: str = "auto",
         nproc: int | None = None, tasks: list[str] | None = None, tasks_path: str = "",
         limit: int | None = None, num_fewshot: int | None = None, batch_size: int = 16,
         skip_checksums: bool = False, **sections: Any) -> Evaluation:
    """``shardwise eval``: ``checkpoint`` (a ``step-<N>`` folder or a run directory) scored on its run's
    held-out data, or on other data and in any layout through the sections (``data={"path": ...}``,
    ``parallel={...}``), on ``nproc`` local ranks; or on lm-evaluation-harness ``tasks``. The scores
    are printed as the command prints them and returned as an :class:`Evaluation`."""
    import json
    import tempfile

    from shardwise.cli import main
    from shardwise.infer.eval_command import Score

    with tempfile.TemporaryDirectory(prefix="shardwise-eval-") as tmp:
        argv = ["eval", "--checkpoint", str(checkpoint), *(["--config", str(config)] if config else []),
                "--split", split, *(["--nproc", str(nproc)] if nproc is not None else []),
                *(["--tasks", ",".join(tasks), "--batch-size", str(batch_size)] if tasks else []),
                *(["--tasks-path", tasks_path] if tasks_path else []),
                *(["--limit", str(limit)] if limit is not None else []),
                *(["--num-fewshot", str(num_fewshot)] if num_fewshot is not None else []),
                *(["--skip-checksums"] if skip_checksums else []), "--out", f"{tmp}/scores.json",
                *_flags(sections)]
        if code := main(argv, raise_errors=True):
            raise RuntimeError(f"shardwise eval ended with exit code {code} (its messages say why)")
        record = json.loads(Path(tmp, "scores.json").read_text())
    scores = {s["name"]: Score(s["name"], s["loss"], s["tokens"], s["sequences"])
              for s in record.get("scores", [])}
    return Evaluation(Path(record["checkpoint"]), scores, record.get("tasks", {}), record.get("split", ""),
                      record.get("seq_len", 0))


@dataclass(frozen=True)
class Prepared:
    """One data source as ``shardwise prepare`` left it: its folder and what its manifest counts."""

    folder: Path
    shards: int
    docs: int
    tokens: int
    val_docs: int
    val_tokens: int
    bad_rows: int


def prepare(config: str | Path | None = None, **sections: Any) -> list[Prepared]:
    """``shardwise prepare``: every source of the config's data (``data={"path": ...}``, or
    ``model="NAME"``'s preset) tokenized into the shards training memory-maps, or resumed where an
    earlier run stopped. Returns each source's :class:`Prepared`; chat packing notices are said."""
    from shardwise.config.notice import notice

    command, args, rest = _parsed(["prepare", *_preset(config, sections), *_flags(sections)])
    folders, packing = command.prepared(args, rest)
    for line in packing:
        notice(line)
    return [Prepared(folder, m["shards"], m["docs"], m["tokens"], m["val_docs"], m["val_tokens"],
                     m["bad_rows"]) for folder, m in folders]


@dataclass(frozen=True)
class Converted:
    """What ``shardwise convert`` wrote: an HF folder's safetensors, or a checkpoint and its config."""

    out: Path
    files: list[Path]
    """Export: the safetensors files written in ``out`` (beside config.json and the tokenizer), or
    with ``adapter`` the PEFT folder's two files."""
    toml: Path | None = None
    """Import: the training config written for the checkpoint (train with ``--config`` it)."""


def convert(*, out: str | Path, to_hf: str | Path | None = None, from_hf: str | Path | None = None,
            dtype: str = "bf16", adapter: bool = False, config: str | Path | None = None,
            toml: str | Path | None = None, overwrite: bool = False, skip_checksums: bool = False,
            **sections: Any) -> Converted:
    """``shardwise convert``: a checkpoint (``to_hf``: a ``step-<N>`` folder or a run directory) to a
    Hugging Face folder ``out`` (``adapter``: a LoRA checkpoint's adapters alone, as a PEFT folder),
    or an HF folder (``from_hf``, or a Hub id) to a checkpoint ``out``
    and its training config (``toml``, default ``<out>.toml``; ``config`` and the sections go into
    it). An existing ``out`` is refused unless ``overwrite``. Returns the :class:`Converted`."""
    way = [*(["--to-hf", str(to_hf)] if to_hf is not None else []),
           *(["--from-hf", str(from_hf)] if from_hf is not None else [])]
    command, args, rest = _parsed(["convert", *way, "--out", str(out), "--dtype", dtype,
                                   *(["--adapter"] if adapter else []),
                                   *(["--config", str(config)] if config is not None else []),
                                   *(["--toml", str(toml)] if toml is not None else []),
                                   *(["--overwrite"] if overwrite else []),
                                   *(["--skip-checksums"] if skip_checksums else []), *_flags(sections)])
    if args.to_hf:
        return Converted(Path(out), command.exported(args, rest)[1])
    return Converted(Path(out), [], command.imported(args, rest)[0])


@dataclass(frozen=True)
class Downloaded:
    """What ``shardwise download`` fetched: ``kind`` "model" or "dataset", and where it is."""

    ref: str
    kind: str
    folder: Path


def download(ref: str, *, out: str | Path | None = None, overwrite: bool = False) -> Downloaded:
    """``shardwise download``: a Hub model (``ORG/NAME[@REVISION]``: config, tokenizer, safetensors) or
    dataset (``hf://datasets/ORG/NAME[@REVISION][/PATH]``) into the Hugging Face cache, where every
    command finds it by its id (offline too), or into the folder ``out``. Returns the
    :class:`Downloaded`."""
    command, args, rest = _parsed(["download", ref, *(["--out", str(out)] if out is not None else []),
                                   *(["--overwrite"] if overwrite else [])])
    kind, folder = command.downloaded(args, rest)
    return Downloaded(ref, kind, folder)
