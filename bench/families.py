"""Training throughput of model families of the same active size, side by side in one process.

DeepSeek-V3's debug preset (latent attention, group-limited sigmoid routing over 8 experts, a shared
expert) against the Qwen3-MoE-style MoE debug preset (grouped-query attention, softmax routing over
8 experts, a shared expert), both with about 6M parameters active per token: the trainer's own
``train_step`` (bf16 mixed precision on a one-rank mesh, eager) on the same batches of the shipped
corpus, steps alternating between the models after warm-up so that machine noise hits both alike.
Reported: the median tokens/s, each family's PaLM MFU and executed-FLOP utilization against this
machine's measured bf16 GEMM peak (measured in the same run), and the ratio.

    python bench/families.py                      # 8 x 2048 tokens per step, 3 warm-up + 8 timed
    python bench/families.py --steps 4 --shape 4 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardwise.config.schema import Config
from shardwise.data.dataset import PackedLoader, open_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.models import PRESETS
from shardwise.models.transformer import build_model, init_weights
from shardwise.observe.flops import attention_pairs, executed_flops, flops_per_token, num_params
from shardwise.observe.peak import measure_gemm_tflops
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.parallelize import parallelize
from shardwise.resolve.run import ResolvedRun, loss_chunk_tokens
from shardwise.runtime.machine import cpu_kind
from shardwise.trainer.loss import TokenLoss
from shardwise.trainer.train import train_step

FAMILIES = ("moe-debug", "deepseek-debug")


def trainer_step(name: str, batch: int, seq: int, steps: int):  # noqa: ANN201 - (step fn, args)
    args = PRESETS[name]
    cfg = Config()
    cfg.training.global_batch, cfg.training.seq_len, cfg.training.steps = batch, seq, steps
    cfg.training.mixed_precision, cfg.compile.enabled = "bf16", False
    dims = ParallelDims.from_config(cfg.parallel, 1)
    dims.build_mesh("cpu")
    run = ResolvedRun(cfg, dims, args, micro_batch=batch, micro_batches=1,
                      loss_chunk=loss_chunk_tokens(cfg.training, args.vocab_size, 1, 1, batch * seq),
                      precision="bf16", device_type="cpu", compile=False)
    model = build_model(args)
    parallelize(model, dims, cfg, False)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    opt = build_optimizer(model, cfg.optimizer, "cpu")
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, steps)
    loss = TokenLoss(run.loss_chunk)
    return (lambda mbs: train_step(model, opt, sched, mbs, run, loss).loss.item()), args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=(8, 2048), metavar=("BATCH", "SEQ"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
    batch, seq = a.shape
    cfg = Config()
    loader = PackedLoader(open_corpus(cfg.data, load_tokenizer("")).train, seq, batch, batch, 0, 1, seed=0,
                          document_mask=False, device="cpu")
    batches = [loader.next_step() for _ in range(a.warmup + a.steps)]
    steps = {n: trainer_step(n, batch, seq, a.warmup + a.steps) for n in FAMILIES}
    times: dict[str, list[float]] = {n: [] for n in FAMILIES}
    for i, mbs in enumerate(batches):
        for name, (step, _) in steps.items():
            t0 = time.perf_counter()
            step(mbs)
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    peak = max(measure_gemm_tflops(torch.bfloat16, torch.device("cpu"), n) for n in (1024, 2048))
    out = {"cpu": cpu_kind(), "shape": [batch, seq], "steps": a.steps, "peak_bf16_tflops": peak}
    for name, (_, args) in steps.items():
        tps = batch * seq / statistics.median(times[name])
        executed = executed_flops(args, batch * seq, batch * attention_pairs(seq)).total / (batch * seq)
        out[name] = {"active_params_m": num_params(args, active=True) / 1e6,
                     "params_m": num_params(args) / 1e6, "tokens_per_s": tps,
                     "mfu": tps * flops_per_token(args, seq) / (peak * 1e12),
                     "exec_util": tps * executed / (peak * 1e12)}
    out["ratio"] = out["deepseek-debug"]["tokens_per_s"] / out["moe-debug"]["tokens_per_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
