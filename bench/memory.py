"""Peak memory and step time of one training step, side by side: plain logits + cross-entropy vs
the chunked fused projection + loss (``training.loss_chunk``), at vocabularies of 32k and 128k.

Each configuration runs in a fresh process (so the peak is its own): build a small Llama body,
run warm-up steps and timed steps of forward + backward + AdamW, and report the process's peak
memory -- the CUDA allocator's peak on GPUs, the RSS high-water mark on CPU -- and the median step
time. The model body is kept small so that the output projection and its logits dominate, as they
do for small models with large vocabularies.

    python bench/memory.py                      # CPU, fp32, 4 x 1024 tokens per step
    python bench/memory.py --device cuda --dtype bf16 --batch 8 --seq 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VOCABS = (32000, 128256)


def child(vocab: int, chunk: int, a: argparse.Namespace) -> dict:
    import dataclasses

    import torch

    from shardwise.models import PRESETS, build_model, init_weights
    from shardwise.observe.memory import peak_memory_gib

    device = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    args = dataclasses.replace(PRESETS["debug"], vocab_size=vocab, dim=a.dim, n_layers=a.layers,
                               max_seq_len=a.seq)
    model = build_model(args, device=device).to(dtype)
    init_weights(model, 0)
    model.loss_chunk = chunk
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab, (a.batch, a.seq), generator=g, device=device)
    labels = torch.randint(0, vocab, (a.batch, a.seq), generator=g, device=device)
    times = []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        if chunk:
            loss = model(tokens, labels=labels) / labels.numel()
        else:
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    return {"peak_gib": peak_memory_gib(device), "step_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="training.loss_chunk of the chunked runs")
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(*a.child, a)))
        return
    tokens = a.batch * a.seq
    print(f"{a.device}, {a.dtype}, body dim {a.dim} x {a.layers} layers, {a.batch} x {a.seq} = {tokens} "
          "tokens per step\n")
    print("| vocab | loss | peak memory (GiB) | step time (s) | fp32 logits alone (GiB) |")
    print("|---|---|---|---|---|")
    results = {}
    for vocab, chunk in [(v, c) for v in VOCABS for c in (0, a.chunk)]:
        argv = [sys.executable, __file__, "--child", str(vocab), str(chunk)] + sys.argv[1:]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        r = results[vocab, chunk] = json.loads(out.strip().splitlines()[-1])
        what = f"chunked ({chunk} tokens)" if chunk else "plain logits + F.cross_entropy"
        print(f"| {vocab:,} | {what} | {r['peak_gib']:.2f} | {r['step_s']:.2f} | "
              f"{tokens * vocab * 4 / 2**30:.2f} |", flush=True)
    print()
    for vocab in VOCABS:
        plain, chunked = results[vocab, 0], results[vocab, a.chunk]
        print(f"vocab {vocab:,}: peak {chunked['peak_gib'] / plain['peak_gib']:.2f}x of plain "
              f"(saves {plain['peak_gib'] - chunked['peak_gib']:.2f} GiB), step time "
              f"{chunked['step_s'] / plain['step_s']:.2f}x")


if __name__ == "__main__":
    main()
