"""Training throughput of shardwise's step vs a plain hand-written PyTorch loop, side by side.

Both train the same ``Transformer`` on the same batches of the shipped corpus in one process:

- **shardwise**: the trainer's own ``train_step`` -- FSDP2 on a 1-rank mesh with bf16 mixed precision
  (fp32 master weights, bf16 compute, fp32 gradient reduction), global-token loss normalization,
  float64 global-norm clipping, fused AdamW, LR scheduler.
- **plain**: fp32 parameters under ``torch.autocast(bfloat16)``, mean cross-entropy, torch's
  ``clip_grad_norm_``, fused AdamW -- what one would write by hand.

Steps alternate between the two (after warm-up) so machine noise hits both alike; the figure is the
median tokens/s. MFU uses the PaLM convention (shardwise.observe.flops) against the measured bf16
GEMM peak of this machine (shardwise.observe.peak, cached).

    python bench/throughput.py                      # debug (8 x 2048) and 125m (4 x 1024)
    python bench/throughput.py --presets debug --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from shardwise.config import Config
from shardwise.data.dataset import IGNORE_INDEX, PackedLoader, open_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.device import init_distributed
from shardwise.models import PRESETS, build_model, init_weights
from shardwise.observe.flops import flops_per_token, num_params
from shardwise.observe.peak import peak_tflops
from shardwise.ops.loss import TokenLoss
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.parallelize import parallelize
from shardwise.resolve import ResolvedRun
from shardwise.train import train_step

SHAPES = {"debug": (8, 2048), "125m": (4, 1024)}  # (sequences per step, sequence length)


def bench_preset(name: str, steps: int, warmup: int, peak: float) -> dict[str, float]:
    batch, seq = SHAPES[name]
    args = PRESETS[name]
    cfg = Config()
    cfg.training.global_batch, cfg.training.seq_len = batch, seq
    device = torch.device("cpu")
    dims = ParallelDims.from_config(cfg.parallel, 1)
    dims.build_mesh("cpu")
    corpus = open_corpus(cfg.data, load_tokenizer(""))
    loader = PackedLoader(corpus.train, seq, batch, batch, 0, 1, seed=0, document_mask=False)
    batches = [loader.next_step() for _ in range(warmup + steps)]

    run = ResolvedRun(cfg, dims, args, micro_batch=batch, micro_batches=1, precision="bf16",
                      device_type="cpu")
    ours = build_model(args)
    cfg.training.mixed_precision = "bf16"
    parallelize(ours, dims, cfg)
    ours.to_empty(device=device)
    init_weights(ours, 0)
    opt = build_optimizer(ours, cfg.optimizer, "cpu")
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, warmup + steps)

    plain = build_model(args, device="cpu")
    init_weights(plain, 0)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)

    def step_ours(mbs):
        train_step(ours, opt, sched, mbs, run, TokenLoss()).loss.item()

    def step_plain(mbs):
        (b,) = mbs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = plain(b.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b.labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        popt.step()
        popt.zero_grad(set_to_none=True)
        loss.item()

    times: dict[str, list[float]] = {"shardwise": [], "plain": []}
    for i, mbs in enumerate(batches):
        for label, fn in (("shardwise", step_ours), ("plain", step_plain)):
            t0 = time.perf_counter()
            fn(mbs)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
    fpt = flops_per_token(args, seq)
    out = {"params_m": num_params(args) / 1e6, "tokens_per_step": batch * seq}
    for label, ts in times.items():
        tps = batch * seq / statistics.median(ts)
        out[f"{label}_tps"] = tps
        out[f"{label}_mfu"] = tps * fpt / (peak * 1e12)
    out["ratio"] = out["shardwise_tps"] / out["plain_tps"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["debug", "125m"], choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=6, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    init_distributed("cpu")
    peak, source = peak_tflops(torch.device("cpu"), "bf16")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, MFU peak {peak:.3f} TFLOP/s "
          f"({source})\n")
    print("| preset | params | tokens/step | shardwise tok/s | plain tok/s | shardwise / plain | "
          "shardwise MFU | plain MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.presets:
        r = bench_preset(name, a.steps, a.warmup, peak)
        b, s = SHAPES[name]
        cells = [name, f"{r['params_m']:.1f}M", f"{b}x{s}", f"{r['shardwise_tps']:,.0f}",
                 f"{r['plain_tps']:,.0f}", f"{r['ratio']:.3f}", f"{100 * r['shardwise_mfu']:.1f}%",
                 f"{100 * r['plain_mfu']:.1f}%"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
