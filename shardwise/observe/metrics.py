"""Metrics sinks on rank 0: ``metrics.jsonl``, TensorBoard, W&B, and what the console shows: a
progress bar on a terminal, or one line (or JSON object) per log interval that a cluster job's log file
can keep (``metrics.log_format``)."""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.config.notice import say
from shardwise.config.schema import ConfigError, MetricsConfig


class Throughput:
    """Tokens/s, step time, MFU (PaLM convention) and executed-FLOPs utilization over the window
    since the last call to :meth:`window`."""

    def __init__(self, flops_per_token: float, peak_tflops: float, world_size: int) -> None:
        self.flops_per_token, self.peak, self.world = flops_per_token, peak_tflops, world_size
        self.reset()

    def add(self, tokens: int, executed_flops_per_device: float | Any = 0.0,
            model_flops_per_device: float | Any | None = None) -> None:
        """One step: global tokens, the FLOPs one device executed and, where the data's masks make
        them differ from ``tokens * flops_per_token``, its PaLM-convention FLOPs (tensors are fine:
        they are only read when the window is)."""
        self._tokens += tokens
        self._flops = self._flops + executed_flops_per_device
        if model_flops_per_device is not None:
            self._model = self._model + model_flops_per_device
        self._steps += 1

    def reset(self) -> None:
        """Start a new window now (e.g. after an eval or a checkpoint, which are not training)."""
        self._t, self._tokens, self._steps, self._flops = time.perf_counter(), 0, 0, 0.0
        self._model: float | Any = 0.0

    def window(self) -> dict[str, float]:
        dt = max(time.perf_counter() - self._t, 1e-9)
        tps = self._tokens / dt
        per_device = tps / self.world
        out = {"tokens_per_s": tps, "tokens_per_s_per_device": per_device,
               "step_time_s": dt / max(self._steps, 1),
               "mfu": per_device * self.flops_per_token / (self.peak * 1e12)}
        if isinstance(self._model, torch.Tensor) or self._model:
            out["mfu"] = float(self._model) / dt / (self.peak * 1e12)
        if self._flops:
            out["exec_util"] = float(self._flops) / dt / (self.peak * 1e12)
        self.reset()
        return out


def per_rank(values: dict[str, float], device: torch.device) -> dict[str, Any]:
    """All-gather a few per-rank figures (every rank must call): each as a list indexed by rank,
    plus the straggler report -- slowest rank's step time over the median rank's."""
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    gathered = torch.empty(dist.get_world_size() * local.numel(), dtype=torch.float64, device=device)
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(gathered, local)
    table = gathered.view(-1, local.numel()).cpu()  # (ranks, figures)
    out: dict[str, Any] = {f"{k}_per_rank": table[:, i].tolist() for i, k in enumerate(values)}
    if "step_time_s" in values:
        times = table[:, list(values).index("step_time_s")]
        out["straggler_ratio"] = (times.max() / times.median().clamp(min=1e-12)).item()
        out["slowest_rank"] = int(times.argmax())
    return out


def _duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def console_record(step: int, total: int, metrics: dict[str, Any], now: float) -> dict[str, Any]:
    """What the console shows of one logged step: time of day, step of total, loss, lr, grad norm,
    tokens/s per device, MFU, peak memory and the ETA (the steps left at this window's step time)."""
    out = {"time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)), "step": step, "total": total,
           "loss": metrics["loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
           "tokens_per_s_per_device": metrics["tokens_per_s_per_device"], "mfu": metrics["mfu"],
           "memory_gib": metrics["memory_gib"], "eta_s": (total - step) * metrics["step_time_s"]}
    for key in ("val_loss", "spike", "expert_load"):
        if key in metrics:
            out[key] = metrics[key]
    return out


def format_line(r: dict[str, Any]) -> str:
    """One log line of :func:`console_record`, for a file a person reads (``grep``, ``tail -f``)."""
    val = f" | val {r['val_loss']:.4f}" if "val_loss" in r else ""
    val += f" | SPIKE {r['spike']:.2f}x" if "spike" in r else ""
    val += f" | experts {r['expert_load']:.2f}x" if "expert_load" in r else ""  # (worst MoE block's load)
    return (f"{r['time']} step {r['step']}/{r['total']} | loss {r['loss']:.4f}{val} | lr {r['lr']:.2e} | "
            f"grad {r['grad_norm']:.3f} | tok/s/dev {r['tokens_per_s_per_device']:,.0f} | "
            f"mfu {100 * r['mfu']:.1f}% | mem {r['memory_gib']:.2f} GiB | eta {_duration(r['eta_s'])}")


def console_format(cfg: MetricsConfig) -> str:
    """``metrics.log_format`` for this process: ``auto`` is the bar where both streams are a terminal
    (the bar draws on stderr), else the line -- so ``| tee`` and a redirected stdout get one line per
    logged step, although stderr is still the terminal."""
    if cfg.log_format != "auto":
        return cfg.log_format
    return "bar" if sys.stderr.isatty() and sys.stdout.isatty() else "line"


WANDB_ID = "wandb/shardwise-run-id"
"""The W&B run id, kept in run.dir so that a resumed run logs on into the same W&B run."""


def wandb_run(run_dir: Path, cfg: MetricsConfig, start_step: int, run_config: dict[str, Any]):  # noqa: ANN201
    """The W&B run of ``run_dir``: the one it logged to before when resuming (its id kept in
    :data:`WANDB_ID`), a new one otherwise."""
    import wandb

    kept = run_dir / WANDB_ID
    resuming = start_step > 0 and kept.is_file()
    # (a new id as W&B makes them: 8 lowercase letters and digits)
    run_id = kept.read_text().strip() if resuming else "".join(
        secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(run_id + "\n")
    mode = None if cfg.wandb_mode == "auto" else cfg.wandb_mode  # (auto left: W&B's own WANDB_MODE decides)
    return wandb.init(project=cfg.wandb_project, dir=str(run_dir), mode=mode, name=run_dir.name,
                      config=run_config, id=run_id, resume="allow" if resuming else None)


MLFLOW_ID = "mlflow-run-id"
"""The MLflow run id, kept in run.dir so that a resumed run logs on into the same MLflow run."""


class MlflowSink:
    """``metrics.mlflow``: the scalars TensorBoard and W&B get, into an MLflow run of the experiment
    MLFLOW_EXPERIMENT_NAME (default "shardwise") named after run.dir, with the run's config as its
    parameters; a resume logs on into the run it started (:data:`MLFLOW_ID`). Logged asynchronously
    (MLflow's own queue), so a remote server's latency does not stall the step."""

    def __init__(self, run_dir: Path, uri: str, start_step: int, run_config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if uri.startswith("sqlite:///") and ":memory:" not in uri:  # (the file's folder, as the run dir's)
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        self._pending: list[Any] = []  # the asynchronous batches not yet known to be written
        kept = run_dir / MLFLOW_ID
        if start_step > 0 and kept.is_file():
            self.run_id = kept.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardwise")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        kept.write_text(self.run_id + "\n")
        params = [Param(f"{section}.{k}", str(v)) for section, values in run_config.items()
                  for k, v in values.items() if v is not None]
        for i in range(0, len(params), 100):  # (MLflow's limit per batch)
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        self._pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        if len(self._pending) >= 100:  # (bounded: the queue is normally drained long before)
            self._wait()

    def _wait(self) -> None:
        # (each batch's own handle: MLflow's module-level flush would open its default store, a
        # mlflow.db in the working directory)
        for op in self._pending:
            op.wait()
        self._pending.clear()

    def close(self) -> None:
        self._wait()
        self.client.set_terminated(self.run_id)


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: MetricsConfig, total_steps: int, start_step: int,
                 enabled: bool, run_config: dict[str, Any] | None = None) -> None:
        self.enabled, self.cfg, self.total = enabled, cfg, total_steps
        self.format = console_format(cfg)
        self.path = run_dir / "metrics.jsonl"
        self._tb = self._bar = self._wandb = self._mlflow = None
        self.notice = ""
        if not enabled:
            return
        self.notice = trim_metrics(self.path, start_step)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
        if cfg.wandb:
            self._wandb = wandb_run(run_dir, cfg, start_step, run_config or {})
        if cfg.mlflow:
            self._mlflow = MlflowSink(run_dir, cfg.mlflow, start_step, run_config or {})
        if self.format == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, mininterval=0.5)

    def due(self, step: int, final: bool) -> bool:
        """Whether ``step`` is logged: every metrics.log_interval steps and the run's final step
        (the loss all-reduce and the host syncs happen only then)."""
        return step % self.cfg.log_interval == 0 or final

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        # a dict of figures (expert_load_layers) is one scalar per entry: "expert_load_layers/3"
        flat = {f"{k}/{sub}" if isinstance(v, dict) else k: x for k, v in metrics.items()
                for sub, x in (v.items() if isinstance(v, dict) else [(None, v)])}
        scalars = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k.replace("val_", "val/"), v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._mlflow is not None:
            self._mlflow.log(step, scalars)
        if self._bar is not None:
            short = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{metrics['tokens_per_s']:,.0f}",
                     "mfu": f"{100 * metrics['mfu']:.1f}%"}
            if "val_loss" in metrics:
                short["val"] = f"{metrics['val_loss']:.4f}"
            self._bar.set_postfix(short, refresh=False)
            return
        r = console_record(step, self.total, metrics, time.time())
        say(json.dumps(r) if self.format == "json" else format_line(r))

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        elif self.format == "json":  # every stdout line stays one JSON object
            say(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "message": text}))
        else:
            say(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The logged records; a line that does not parse (a crash mid-write) is skipped, a parsed one
    that is not a record with an integer ``step`` is a one-line error (not a log shardwise wrote)."""
    if not path.is_file():
        return []
    records = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"'{path}' cannot be read as a metrics log ({e}): pass a run directory") from None
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            what = "has no integer 'step'" if isinstance(row, dict) else f"is a JSON {type(row).__name__}"
            raise ConfigError(f"'{path}' line {n} {what}: not a record shardwise logged (the file was edited "
                              "or is another tool's): remove that line")
        records.append(row)
    return records


def trim_metrics(path: Path, step: int) -> str:
    """Before a run logs from ``step + 1``: keep ``path``'s records up to ``step`` (a resumed run
    appends after them), drop the rest -- rows an interrupted run logged past the checkpoint it is
    resumed from, or a line cut by a crash. The file is replaced atomically and only if something
    is dropped; returns a notice saying what, or ''."""
    if not path.is_file():
        return ""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if len(kept) == len(lines):
        return ""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    tmp.replace(path)
    return (f"metrics.jsonl: dropped {len(lines) - len(kept)} record(s) logged after step {step} (by the "
            f"interrupted run, past the checkpoint this run continues from); kept {len(kept)}")
