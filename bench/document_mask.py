"""Causal vs document-masked training steps, side by side, through the real CLI.

Each variant trains the debug preset on one window of ``--seq`` tokens per step from the shipped
corpus (whose windows hold several documents each), in its own process, so each process's peak RSS
is its own: tokens/s is the median over the steps after the first two, memory the process's peak.

    python bench/document_mask.py                     # S = 8192, 8 steps each
    python bench/document_mask.py --seq 32768 --steps 3
    python bench/document_mask.py --tails             # torch's CPU flash kernel vs distinct lengths

``--tails`` measures why document runs are aligned (models/layers.py ``RUN_ALIGN``): the peak RSS of
bf16 CPU flash attention (forward + backward) over 400 calls whose lengths are all different, then
400 whose lengths are multiples of 64.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_variant(seq: int, steps: int, masked: bool, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", str(ROOT / "configs" / "debug.toml"),
           "--model.max_seq_len", str(seq), "--training.seq_len", str(seq), "--training.global_batch", "1",
           "--training.steps", str(steps), "--eval.interval", "0", "--checkpoint.interval", "0",
           "--checkpoint.final", "false", "--metrics.plot", "false", "--metrics.tensorboard", "false",
           "--metrics.log_format", "line", "--data.document_mask", str(masked).lower(),
           "--run.dir", str(out), "--compile.enabled", "false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[2:] or rows),
            "peak_gib": max(r["memory_gib"] for r in rows), "mfu": statistics.median(r["mfu"] for r in rows)}


def documents_per_window(seq: int, windows: int = 16) -> float:
    """Mean documents per window of the shipped corpus at this length (its first windows in the
    training order)."""
    from shardwise.config.schema import Config
    from shardwise.data.dataset import PackedLoader, open_corpus
    from shardwise.data.tokenizer import load_tokenizer

    corpus = open_corpus(Config().data, load_tokenizer(""))
    loader = PackedLoader(corpus.train, seq, 1, 1, 0, 1, seed=42, document_mask=True)
    counts = [int(loader.next_step()[0].doc_ids.max()) + 1 for _ in range(windows)]
    return sum(counts) / len(counts)


def tails(calls: int = 400) -> dict[str, float]:
    """Peak RSS (MiB) of torch's bf16 CPU flash attention after ``calls`` distinct lengths, then
    after ``calls`` lengths that are multiples of 64 (run in fresh processes)."""
    code = f"""
import random, resource, sys, torch
random.seed(0)
for i in range({calls}):
    n = random.randint(2, 31) * 64 if sys.argv[1] == "aligned" else 100 + i * 4 + random.randint(0, 3)
    q, k, v = (torch.randn(1, 16, n, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
    out = {}
    for kind in ("distinct", "aligned"):
        res = subprocess.run([sys.executable, "-c", code, kind], check=True, capture_output=True, text=True)
        out[f"{kind}_peak_mib"] = float(res.stdout.strip())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tails", action="store_true")
    p.add_argument("--json", default="")
    a = p.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    result: dict[str, object] = {"cpu": cpu}
    if a.tails:
        result.update(tails())
    else:
        result["seq"], result["documents_per_window"] = a.seq, documents_per_window(a.seq)
        with tempfile.TemporaryDirectory() as d:
            for masked in (False, True):
                result["document" if masked else "causal"] = run_variant(a.seq, a.steps, masked,
                                                                         Path(d) / str(masked))
        c, m = result["causal"], result["document"]
        result["speed_ratio"] = m["tokens_per_s"] / c["tokens_per_s"]
        result["memory_ratio"] = m["peak_gib"] / c["peak_gib"]
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
