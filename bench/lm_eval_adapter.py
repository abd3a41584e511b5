"""lm-eval requests/s: shardwise's adapter (one request per forward, then batched) beside lm-eval's
own Hugging Face backend on the exported folder of the same checkpoint -- and the scores each gives.

    python bench/lm_eval_adapter.py                     # the debug preset, 400 requests
    python bench/lm_eval_adapter.py --requests 200 --config configs/debug.toml --batch-size 32

The checkpoint is the preset's model after one training step (what the weights are does not change
the cost), exported to a Hugging Face folder in fp32. The requests are lm-eval ``loglikelihood``
ones from the shipped corpus: a context of 10-150 words and a continuation of 1-5 words, the shape
of multiple-choice tasks. Each side scores the same requests in fp32 on this machine's CPU threads;
the largest difference between the two sides' log-likelihoods and the greedy flags that differ are
printed with the rates.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.infer.generate import load_for_generation  # noqa: E402
from shardwise.infer.harness import _adapter  # noqa: E402


def requests(n: int, seed: int = 0) -> list:
    from lm_eval.api.instance import Instance

    with gzip.open(ROOT / "shardwise" / "data" / "assets" / "kjv.jsonl.gz", "rt") as f:
        words = " ".join(json.loads(line)["text"] for _, line in zip(range(2000), f, strict=False)).split()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        at, k, m = rng.randrange(len(words) - 200), rng.randint(10, 150), rng.randint(1, 5)
        out.append(Instance("loglikelihood", {}, (" ".join(words[at:at + k]),
                                                  " " + " ".join(words[at + k:at + k + m])), i))
    return out


def timed(fn, reqs: list) -> tuple[float, list]:  # noqa: ANN001
    start = time.perf_counter()
    out = fn(reqs)
    return len(reqs) / (time.perf_counter() - start), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/debug.toml")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    from lm_eval.models.huggingface import HFLM

    with tempfile.TemporaryDirectory() as tmp:
        run, hf = Path(tmp) / "run", Path(tmp) / "hf"
        shardwise = [sys.executable, "-m", "shardwise"]
        subprocess.run([*shardwise, "train", "--config", args.config, f"--run.dir={run}",
                        "--training.steps=1", "--checkpoint.final=true", "--eval.interval=0",
                        "--metrics.log_format=line", "--training.mixed_precision=fp32"],
                       check=True, cwd=ROOT, capture_output=True)
        subprocess.run([*shardwise, "convert", "--to-hf", str(run / "checkpoints" / "step-1"), "--out",
                        str(hf), "--dtype", "fp32"], check=True, cwd=ROOT, capture_output=True)
        reqs = requests(args.requests)
        loaded = load_for_generation(checkpoint=str(run), device="cpu", dtype="fp32")
        sides = {"shardwise, 1 per forward": _adapter(loaded, 1).loglikelihood,
                 f"shardwise, batch {args.batch_size}": _adapter(loaded, args.batch_size).loglikelihood}
        for b in (1, args.batch_size):
            theirs = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=b)
            sides[f"lm-eval HF backend, batch {b}"] = (
                lambda r, t=theirs: t.loglikelihood(r, disable_tqdm=True))
        timed(sides[f"shardwise, batch {args.batch_size}"], reqs[:16])  # (warm-up: allocator, kernels)
        results = {name: timed(fn, reqs) for name, fn in sides.items()}
    base = results["shardwise, 1 per forward"][1]
    print(f"{args.requests} loglikelihood requests, {args.config} (fp32), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    for name, (rate, out) in results.items():
        diff = max(abs(a - b) for (a, _), (b, _) in zip(base, out, strict=True))
        flips = sum(ga != gb for (_, ga), (_, gb) in zip(base, out, strict=True))
        print(f"  {name:32s} {rate:8.1f} requests/s   max |log-lik diff| {diff:.2e}, "
              f"greedy flags differing {flips}")


if __name__ == "__main__":
    main()
