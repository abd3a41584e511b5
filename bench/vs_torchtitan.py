"""shardwise beside torchtitan on the same GPU: the same model shape, tokens, precision, activation
checkpointing and compile setting, the same number of measured steps after warm-up.

Each side trains in a process of its own (a fresh allocator, so each peak is its own; a fresh
process group -- both frameworks initialize torch.distributed), one after the other on the same
device; the second repeat runs the two in the other order. Both get the same token ids (seeded random
tokens over the model's vocabulary) and plain causal attention over each whole row.

- **torchtitan**: its own ``Trainer`` (a PyPI release, 0.2.x: 0.3.0 imports
  ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.11 lacks), built by its own
  ``ConfigManager`` from command-line flags, stepped with its own ``train_step``. On one GPU that is
  fp32 parameters under bf16 autocast, no FSDP, the plain cross-entropy loss. Its tokenizer and data
  loader are not built (the batches come from here); ``PYTORCH_ALLOC_CONF=expandable_segments:True``
  as its ``run_train.sh`` sets. Its metrics logger resets the allocator's peak after every step; the
  worker stops that so its peak covers the run, as shardwise's does.
- **shardwise**: the trainer's own parts (``resolve_run`` -> ``build_rank_model`` -> ``train_step``)
  with its defaults for one GPU (``parallel.one_rank=auto``: no FSDP, fp32 parameters, the forward
  under bf16 autocast with a bf16 residual stream), the fused chunked loss. ``shardwise-fsdp`` is
  FSDP2 on a one-rank mesh instead (``one_rank=fsdp``: bf16 parameter copies, gradients reduced in
  fp32), ``shardwise-plain`` forces the GPU's default on a CPU (the smoke test), and
  ``shardwise-fp8-rowwise`` / ``-tensorwise`` add float8 training.

Every step ends with ``torch.cuda.synchronize()``; the figure is the median step over the measured
steps. MFU is given in two conventions against the H100 SXM's 989.4 TFLOP/s dense bf16 data-sheet
peak (torchtitan's denominator): PaLM (6N + 12 L H d S per token, no causal discount: what torchtitan
logs) and executed FLOPs (exact causal attention pairs, recomputation counted).

    python bench/vs_torchtitan.py --out vs.json --profile-dir prof   # the four shapes, two repeats
    python bench/vs_torchtitan.py --report vs.json                   # the tables of a saved run
    python bench/vs_torchtitan.py --device cpu --shapes tiny tiny-moe --repeats 1 --steps 2 --warmup 1

The last is a smoke test of the harness on CPU (torchtitan 0.2 is told the CPU is its device; its
MoE does not run on CPU: ``histc`` has no CPU kernel for int64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

H100_PEAK_TFLOPS = 989.4  # dense bf16, SXM data sheet (torchtitan's MFU denominator)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One workload, as each framework spells it."""

    family: str  # torchtitan's model package: llama3 / qwen3
    flavor: str  # torchtitan's registry flavor
    preset: str  # shardwise's model preset
    batch: int
    seq: int
    ac: str = "none"  # none / selective (torchtitan's per-op SAC = shardwise's selective_half) / full
    n_layers: int = 0  # 0 = the flavor's own; else the first n_layers blocks
    overrides: tuple[tuple[str, Any], ...] = ()  # shardwise [model] fields that make the preset the flavor


# torchtitan 0.2's Llama has no tied embeddings: Llama-3.2-1B's shape runs untied on both sides
_UNTIED = (("tie_embeddings", False),)
# torchtitan balances experts by a routing bias (load_balance_coeff 1e-3, no auxiliary loss)
_BIAS_BALANCE = (("moe_balance", "bias"), ("moe_bias_rate", 1e-3), ("moe_aux_coef", 0.0))
# torchtitan qwen3 "debugmodel_moe" in shardwise's fields (no shared expert, no dense block)
_QWEN3_MOE_DEBUG = (("dim", 256), ("n_layers", 8), ("n_heads", 16), ("n_kv_heads", 8), ("head_size", 128),
                    ("n_experts", 64), ("moe_top_k", 8), ("moe_hidden_dim", 768), ("vocab_size", 2048),
                    ("max_seq_len", 4096))

SHAPES: dict[str, Shape] = {
    "1b-4x2048": Shape("llama3", "1B", "1b", 4, 2048, overrides=_UNTIED),
    "1b-1x8192": Shape("llama3", "1B", "1b", 1, 8192, overrides=_UNTIED),
    # Llama-3 8B's blocks at its published sequence; 8 of its 32 blocks leave room on an 80 GB GPU
    # (about 2.8B parameters at 16-18 bytes each of weights, gradients and AdamW states).
    "8b-8layers-1x8192": Shape("llama3", "8B", "8b", 1, 8192, ac="selective", n_layers=8),
    # Qwen3-30B-A3B's blocks (128 experts, top 8, width 768): 3 of its 48 blocks fit one GPU.
    "qwen3moe-3layers-2x4096": Shape("qwen3", "30B-A3B", "qwen3-30b-a3b", 2, 4096, n_layers=3,
                                     overrides=_BIAS_BALANCE),
    "qwen3moe-debug-4x4096": Shape("qwen3", "debugmodel_moe", "qwen3-30b-a3b", 4, 4096,
                                   overrides=_QWEN3_MOE_DEBUG + _BIAS_BALANCE),
    # CPU smoke tests: torchtitan's llama3 and qwen3 MoE debug models, cut short
    "tiny": Shape("llama3", "debugmodel", "debug", 2, 256, ac="selective", n_layers=2),
    "tiny-moe": Shape("qwen3", "debugmodel_moe", "qwen3-30b-a3b", 2, 256, n_layers=2,
                      overrides=_QWEN3_MOE_DEBUG + _BIAS_BALANCE),
}

TORCHTITAN_FLAVORS: dict[str, Any] = {}  # filled in torchtitan's worker

SIDES = ("torchtitan", "shardwise", "shardwise-fsdp", "shardwise-plain", "shardwise-fp8-rowwise",
         "shardwise-fp8-tensorwise")


def shardwise_side(side: str) -> tuple[str, str]:
    """(float8 recipe or "off", parallel.one_rank) of a shardwise side's name."""
    rest = side.removeprefix("shardwise").removeprefix("-")
    if rest.startswith("fp8-"):
        return rest.removeprefix("fp8-"), "auto"
    return "off", rest or "auto"


def token_batches(vocab: int, batch: int, seq: int, n: int, seed: int = 0) -> list[tuple[Any, Any]]:
    """``n`` (inputs, labels) pairs of (batch, seq) int64 token ids, the same on both sides."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def shardwise_config(shape: Shape, device: str, float8: str = "off", one_rank: str = "auto") -> Any:
    """The shardwise Config of ``shape`` (a run of 1,000 steps: compile.enabled=auto compiles it)."""
    from shardwise.config.schema import Config

    cfg = Config()
    cfg.model.name = shape.preset
    for k, v in shape.overrides:
        setattr(cfg.model, k, v)
    if shape.n_layers:
        cfg.model.n_layers = shape.n_layers
    cfg.run.device = device
    cfg.training.global_batch, cfg.training.seq_len, cfg.training.steps = shape.batch, shape.seq, 1000
    cfg.training.mixed_precision = "bf16"
    cfg.optimizer.lr, cfg.lr_scheduler.warmup_steps = 3e-4, 10  # as the torchtitan side
    cfg.activation_checkpoint.mode = {"none": "none", "selective": "selective_half", "full": "full"}[shape.ac]
    cfg.float8.enabled, cfg.float8.recipe = float8 != "off", "tensorwise" if float8 == "off" else float8
    cfg.parallel.one_rank = one_rank
    return cfg


# ---------------------------------------------------------------------------------------------
# The two workers (each in a process of its own)
# ---------------------------------------------------------------------------------------------

def _timed_steps(step, n_warmup: int, n_steps: int, device: str) -> dict[str, Any]:
    """Run ``step(i)`` warm-up + measured times, each ended by a device sync; peaks over all."""
    import torch

    cuda = device == "cuda"
    times = []
    first = 0.0
    for i in range(n_warmup + n_steps):
        t0 = time.perf_counter()
        loss = step(i)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i == 0:
            first = dt
        if i >= n_warmup:
            times.append(dt)
    out = {"first_step_s": first, "step_s": times, "median_step_s": statistics.median(times),
           "last_loss": loss}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def run_shardwise(shape: Shape, device: str, steps: int, warmup: int, float8: str, one_rank: str,
                  profile_json: str) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from shardwise.data.dataset import Batch
    from shardwise.optim.adamw import build_optimizer
    from shardwise.optim.lr import build_lr_scheduler
    from shardwise.resolve.run import resolve_run
    from shardwise.runtime.distributed import init_distributed
    from shardwise.trainer.build import build_rank_model
    from shardwise.trainer.loss import TokenLoss
    from shardwise.trainer.train import train_step

    t0 = time.perf_counter()
    cfg = shardwise_config(shape, device, float8, one_rank)
    env = init_distributed(device)
    run = resolve_run(cfg, 1)
    run.dims.build_mesh(env.device.type)
    torch.manual_seed(0)
    model = build_rank_model(run, env.device)
    loss = TokenLoss(run.loss_chunk, compiled=run.compile)
    opt = build_optimizer(model, cfg.optimizer, env.device.type)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
    data = token_batches(run.model.vocab_size, shape.batch, shape.seq, warmup + steps + 1)
    mb = run.micro_batch

    def batches(i: int) -> list[Batch]:
        x, y = data[i]
        return [Batch(x[j:j + mb].to(env.device), y[j:j + mb].to(env.device), None, mb * shape.seq)
                for j in range(0, shape.batch, mb)]

    setup = time.perf_counter() - t0
    r = _timed_steps(lambda i: train_step(model, opt, sched, batches(i), run, loss).loss.item(),
                     warmup, steps, env.device.type)
    if profile_json:
        _profile(f"shardwise {shape.preset}", lambda: train_step(
            model, opt, sched, batches(warmup + steps), run, loss).loss.item(), shape, r, env.device.type,
            profile_json)
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    config = {"model": dataclasses.asdict(run.model), "layout": str(run), "compile": run.compile,
              "loss_chunk_tokens": run.loss_chunk, "micro_batch": mb, "ac": cfg.activation_checkpoint.mode,
              "float8": cfg.float8.recipe if cfg.float8.enabled else "off",
              "optimizer": dataclasses.asdict(cfg.optimizer),
              "one_rank": one_rank, "fsdp": fsdp, "param_dtype": str(next(model.parameters()).dtype),
              "autocast": "bf16" if not fsdp and cfg.training.mixed_precision == "bf16" else "off"}
    return {**r, "setup_s": setup, "config": config}


def run_torchtitan(shape: Shape, device: str, steps: int, warmup: int, dump: str,
                   profile_json: str = "") -> dict[str, Any]:
    """torchtitan 0.2.x's ``Trainer`` on ``shape``, stepped with its own ``train_step``."""
    import dataclasses as dc


    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    import torchtitan
    import torchtitan.tools.utils as tt_utils
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
    from torchtitan.train import Trainer

    if device == "cpu":  # torchtitan 0.2 assumes an accelerator; the smoke test tells it the CPU
        accelerator = tt_utils.device_type
        for mod in [m for name, m in sys.modules.items() if name.startswith("torchtitan")]:
            if getattr(mod, "device_type", None) == accelerator:
                mod.device_type, mod.device_module = "cpu", _CpuModule()

    from torchtitan.tools.logging import init_logger

    init_logger()  # its own per-step line (loss, memory, tps, mfu) goes to the side's log
    t0 = time.perf_counter()
    spec = get_train_spec(shape.family)
    args = TORCHTITAN_FLAVORS.get(shape.flavor) or spec.model_args[shape.flavor]
    if shape.n_layers:
        args = dc.replace(args, n_layers=shape.n_layers)
    # The batches come from here: no tokenizer or data loader is built.
    register_train_spec("bench", dc.replace(spec, model_args={"bench": args}, build_tokenizer_fn=None,
                                            build_dataloader_fn=None))
    compiled = device == "cuda"
    cli = ["--model.name", "bench", "--model.flavor", "bench", "--job.dump_folder", dump,
           "--training.local_batch_size", str(shape.batch), "--training.seq_len", str(shape.seq),
           "--training.steps", "1000", "--lr_scheduler.warmup_steps", "10", "--optimizer.lr", "3e-4",
           "--metrics.log_freq", "1",  # reads loss and grad norm every step (a sync)
           "--activation_checkpoint.mode", shape.ac, "--activation_checkpoint.selective_ac_option", "op"]
    if compiled:
        cli += ["--compile.enable"]
    job = ConfigManager().parse_args(cli)
    trainer = Trainer(job)
    data = token_batches(args.vocab_size, shape.batch, shape.seq, warmup + steps + 1)

    def step(i: int) -> None:
        x, y = data[i]
        trainer.step += 1
        trainer.train_step(trainer.batch_generator([({"input": x}, y)]))

    setup = time.perf_counter() - t0
    # Its logger resets the allocator's peak at every step (its per-step "memory" figure): keep the
    # peak over the whole run instead, as the shardwise side has it.
    trainer.metrics_processor.device_memory_monitor.reset_peak_stats = lambda: None
    r = _timed_steps(step, warmup, steps, device)
    if profile_json:
        _profile(f"torchtitan {shape.flavor}", lambda: step(warmup + steps), shape, r, device, profile_json)
    model = trainer.model_parts[0]
    config = {"torchtitan": torchtitan.__version__, "family": shape.family, "flavor": shape.flavor,
              "model_args": {k: str(v) for k, v in dc.asdict(args).items()},
              "ac": f"{shape.ac} (selective_ac_option op)" if shape.ac == "selective" else shape.ac,
              "compile": f"{compiled} (components {job.compile.components})",
              "flops_per_token_torchtitan": trainer.metrics_processor.num_flops_per_token,
              "params": sum(p.numel() for p in model.parameters()),
              "param_dtype": str(next(model.parameters()).dtype),
              "mixed_precision": f"autocast {job.training.mixed_precision_param} (one device, no FSDP)",
              "loss": type(trainer.loss_fn).__qualname__ if not callable(trainer.loss_fn) else
              getattr(trainer.loss_fn, "__name__", str(trainer.loss_fn)),
              "optimizer": f"{job.optimizer.name} lr {job.optimizer.lr} eps {job.optimizer.eps} "
                           f"wd {job.optimizer.weight_decay} implementation {job.optimizer.implementation}"}
    trainer.close()
    return {**r, "setup_s": setup, "config": config}


def _torchtitan_flavors() -> dict[str, Any]:
    """Flavors torchtitan 0.2 lacks, in its own model args (imported only in its worker)."""
    try:
        from torchtitan.models.llama3 import TransformerModelArgs
    except ImportError:
        return {}
    # Llama-3.2-1B's shape; torchtitan 0.2's Llama cannot tie the embedding to the output head, so
    # both sides run it untied (shardwise: tie_embeddings=False).
    return {"1B": TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                       ffn_dim_multiplier=1.5, multiple_of=1024, rope_theta=500000)}


def _profile(name: str, step, shape: Shape, r: dict[str, Any], device: str, dump: str) -> None:
    """One more step under torch's profiler: its top kernels printed, all written to ``dump``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput import print_profile  # (bench/throughput.py)

    tps = shape.batch * shape.seq / r["median_step_s"]
    print_profile(name, step, 30, device, dump, {"batch": shape.batch, "seq": shape.seq, "tokens_per_s": tps})


class _CpuModule:
    """What torchtitan 0.2 asks of ``torch.cuda``, for the CPU smoke test (no memory figures)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(*_: Any) -> Any:
        return type("Props", (), {"total_memory": 1 << 40, "name": "cpu"})()

    @staticmethod
    def memory_stats(*_: Any) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(*_: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


class _NotBuilt:
    """Stands in for torchtitan's tokenizer and data-loader configs: building it builds nothing."""

    def build(self, **_: Any) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------------------------

def flops(shape: Shape) -> tuple[float, float]:
    """(PaLM FLOPs per token, executed FLOPs per token) of ``shape`` by shardwise's accounting."""
    from shardwise.models import model_args
    from shardwise.observe.flops import attention_pairs, executed_flops, flops_per_token

    cfg = shardwise_config(shape, "cpu")
    args = model_args(cfg.model)
    tokens = shape.batch * shape.seq
    pairs = shape.batch * attention_pairs(shape.seq)
    ex = executed_flops(args, tokens, pairs, cfg.activation_checkpoint.mode)
    return flops_per_token(args, shape.seq), ex.total / tokens


def run_side(side: str, shape_name: str, a: argparse.Namespace, profile_json: str = "") -> dict[str, Any]:
    """One side in a process of its own; torchtitan again without CUDA graphs if they fail."""
    failures = []
    for extra in [[]]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--worker", side, "--shapes", shape_name, "--device", a.device,
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--result", str(out), *extra]
            if profile_json:
                cmd += ["--profile-json", profile_json]
            env = dict(os.environ)
            if side == "torchtitan" and a.device == "cuda":
                env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # as its run_train.sh
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.side_timeout)
            wall = time.perf_counter() - t0
            log = Path(a.logs) / f"{shape_name}_{side}_{int(time.time())}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(p.stdout + p.stderr)
            if p.returncode == 0 and out.exists():
                r = json.loads(out.read_text())
                return {**r, "process_s": wall, "failed_attempts": failures}
            tail = (p.stdout + p.stderr).strip().splitlines()[-6:]
            failures.append({"args": extra, "rc": p.returncode, "tail": tail})
            print(f"  {side} {' '.join(extra)} failed (rc {p.returncode}):\n    " + "\n    ".join(tail),
                  flush=True)
    return {"failed": True, "failed_attempts": failures}


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    shape = SHAPES[rec["shape"]]
    if rec.get("failed"):
        return {}
    tokens = shape.batch * shape.seq
    tps = tokens / rec["median_step_s"]
    palm, ex = rec["flops_per_token"]
    return {"tps": tps, "mfu_palm": tps * palm / (H100_PEAK_TFLOPS * 1e12),
            "mfu_exec": tps * ex / (H100_PEAK_TFLOPS * 1e12)}


def report(records: list[dict[str, Any]]) -> None:
    print("| shape | run | side | tok/s | MFU PaLM | MFU executed | peak alloc GiB | peak reserved GiB "
          "| first step s | setup s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        s = summarize(rec)
        if not s:
            why = rec["failed_attempts"][-1]["tail"][-1] if rec.get("failed_attempts") else "?"
            print(f"| {rec['shape']} | {rec['repeat']} | {rec['side']} | failed: {why[:100]} |||||||")
            continue
        print(f"| {rec['shape']} | {rec['repeat']} | {rec['side']} | {s['tps']:,.0f} | "
              f"{100 * s['mfu_palm']:.1f}% | {100 * s['mfu_exec']:.1f}% | "
              f"{rec.get('peak_allocated_gib', 0):.2f} | {rec.get('peak_reserved_gib', 0):.2f} | "
              f"{rec['first_step_s']:.1f} | {rec['setup_s']:.1f} |")
    # ratios: shardwise / torchtitan within each repeat of a shape
    print("\n| shape | run | side | side / torchtitan tok/s | reserved GiB: side, torchtitan |")
    print("|---|---|---|---|---|")
    by = {(r["shape"], r["repeat"], r["side"]): r for r in records}
    for (shape, rep, side), r in by.items():
        if side == "torchtitan":
            continue
        t = by.get((shape, rep, "torchtitan"))
        if t is None or t.get("failed") or r.get("failed"):
            continue
        ratio = summarize(r)["tps"] / summarize(t)["tps"]
        print(f"| {shape} | {rep} | {side} | {ratio:.3f} | {r.get('peak_reserved_gib', 0):.2f}, "
              f"{t.get('peak_reserved_gib', 0):.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1b-4x2048", "1b-1x8192", "8b-8layers-1x8192",
                                                   "qwen3moe-3layers-2x4096"], choices=list(SHAPES))
    p.add_argument("--sides", nargs="+", default=["torchtitan", "shardwise"], choices=SIDES)
    p.add_argument("--repeats", type=int, default=2, help="runs of each side per shape, order alternating")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="vs_torchtitan.json", help="results, rewritten after each side")
    p.add_argument("--logs", default="vs_torchtitan_logs", help="each side's output")
    p.add_argument("--profile-dir", default="", help="profile one extra step of each side per shape (first "
                   "repeat) and write its kernels to DIR/<shape>_<side>.json")
    p.add_argument("--side-timeout", type=float, default=900.0, help="seconds for one side's process")
    p.add_argument("--report", default="", help="print the tables of a saved --out file and exit")
    # worker mode (internal)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--profile-json", default="", help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.report:
        report(json.loads(Path(a.report).read_text())["records"])
        return
    if a.worker:
        shape = SHAPES[a.shapes[0]]
        if a.worker == "torchtitan":
            TORCHTITAN_FLAVORS.update(_torchtitan_flavors())
            with tempfile.TemporaryDirectory() as dump:
                r = run_torchtitan(shape, a.device, a.steps, a.warmup, dump, a.profile_json)
        else:
            f8, one_rank = shardwise_side(a.worker)
            r = run_shardwise(shape, a.device, a.steps, a.warmup, f8, one_rank, a.profile_json)
        Path(a.result).write_text(json.dumps(r))
        return

    import torch

    where = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    meta = {"torch": torch.__version__, "device": where,
            "steps": a.steps, "warmup": a.warmup, "peak_tflops": H100_PEAK_TFLOPS,
            "shapes": {n: dataclasses.asdict(SHAPES[n]) for n in a.shapes}}
    try:
        import torchtitan
        meta["torchtitan"] = torchtitan.__version__
    except ImportError as e:
        meta["torchtitan"] = f"not importable: {e}"
    print(json.dumps(meta), flush=True)
    records: list[dict[str, Any]] = []
    for rep in range(1, a.repeats + 1):
        for name in a.shapes:
            sides = a.sides if rep % 2 else list(reversed(a.sides))
            for side in sides:
                prof = ""
                if a.profile_dir and rep == 1:
                    Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
                    prof = str(Path(a.profile_dir) / f"{name}_{side}.json")
                print(f"{name} run {rep}: {side} ...", flush=True)
                rec = {"shape": name, "repeat": rep, "side": side, "flops_per_token": flops(SHAPES[name]),
                       **run_side(side, name, a, prof)}
                records.append(rec)
                s = summarize(rec)
                if s:
                    print(f"  {s['tps']:,.0f} tok/s, MFU {100 * s['mfu_palm']:.1f}% (PaLM), reserved "
                          f"{rec.get('peak_reserved_gib', 0):.2f} GiB, first step "
                          f"{rec['first_step_s']:.1f} s, "
                          f"process {rec['process_s']:.0f} s", flush=True)
                Path(a.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    report(records)


if __name__ == "__main__":
    main()
