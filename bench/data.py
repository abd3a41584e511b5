"""Data path at pretraining scale, side by side on this machine.

Builds a large jsonl corpus from the shipped one (every copy a fresh shuffle of the chapters; written
under --work, never committed), then measures:

1. preparation throughput (``shardwise prepare``, every core) against one process running
   ``tokenizers.encode_batch`` over the same text, with its own thread pool and with one thread;
2. peak resident memory of preparation (the whole process tree) on a 1x and a 4x corpus;
3. each rank's resident memory at the first training step on 2 ranks, shipped corpus vs the 4x one;
4. loader throughput in sequences/s for the debug shape against what training consumes, and the
   time to the first step on the prepared 4x corpus.

    python bench/data.py                  # 0.5 GB and 2 GB corpora (about 15 minutes on 2 cores)
    python bench/data.py --size-gb 0.2    # a quick look
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.data.tokenizer import SHIPPED_CORPUS  # noqa: E402

PY = sys.executable
MB = 1 << 20


def build_corpus(path: Path, size: int) -> None:
    """Shuffled copies of the shipped chapters until ``size`` bytes of jsonl."""
    if path.exists() and path.stat().st_size >= size:
        return
    with gzip.open(SHIPPED_CORPUS, "rt") as f:
        rows = [line.rstrip("\n") for line in f if line.strip()]
    tmp = path.with_suffix(".tmp")
    written, copy = 0, 0
    with open(tmp, "w") as out:
        while written < size:
            random.Random(copy).shuffle(rows)
            block = "\n".join(rows) + "\n"
            out.write(block)
            written += len(block.encode())
            copy += 1
    tmp.rename(path)


def tree_rss(pid: int) -> tuple[int, dict[int, int]]:
    """Resident bytes of ``pid`` and all its descendants (sum), and per process."""
    per: dict[int, int] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            per[p] = int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return sum(per.values()), per


def run_sampled(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak summed RSS of the process tree, output) of a command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid)[0])
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    th.join()
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return time.perf_counter() - t0, peak[0], out


BASELINE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
tokens, batch, held, t0 = 0, [], 0, time.perf_counter()
def flush():
    global tokens
    tokens += sum(len(e.ids) + 2 for e in tok.encode_batch(batch, add_special_tokens=False))
with open(sys.argv[1], "rb") as f:
    for line in f:
        text = json.loads(line)["text"]
        batch.append(text); held += len(text)
        if held >= 1 << 20:
            flush(); batch, held = [], 0
if batch:
    flush()
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}))
"""


def prepare_cmd(corpus: Path, out: Path) -> list[str]:
    return [PY, "-m", "shardwise", "prepare", "--config", "configs/debug.toml", f"--data.path={corpus}",
            f"--data.prepared_dir={out}"]


def manifest(out: Path, corpus: Path) -> dict:
    return json.loads((out / corpus.name.split(".")[0] / "manifest.json").read_text())


def first_step(corpus: str, run_dir: Path, cache: Path, prepared: Path | None = None,
               ) -> tuple[float, list[float], float]:
    """Wall time of a 2-step 2-rank run, each rank's resident GiB at its first step, and the
    sequences/s training consumed at the second."""
    args = [PY, "-m", "shardwise", "train", "--config", "configs/debug.toml", "--nproc", "2",
            "--training.steps=2", "--eval.interval=0", "--checkpoint.interval=0",
            "--checkpoint.final=false", "--metrics.plot=false", "--metrics.tensorboard=false",
            f"--run.dir={run_dir}", "--run.overwrite=true", f"--data.cache_dir={cache}"]
    if corpus:
        args.append(f"--data.path={corpus}")
    if prepared:
        args.append(f"--data.prepared_dir={prepared}")
    t, _, _ = run_sampled(args)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return t, rows[0]["memory_gib_per_rank"], rows[1]["tokens_per_s"] / 512


def loader_rate(corpus: Path, prepared: Path, steps: int = 200) -> float:
    from shardwise.data.dataset import PackedLoader, open_corpus
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.resolve.checks import load_config

    cfg = load_config(ROOT / "configs/debug.toml",
                      [f"--data.path={corpus}", f"--data.prepared_dir={prepared}"])
    t = cfg.training
    c = open_corpus(cfg.data, load_tokenizer(""))
    loader = PackedLoader(c.train, t.seq_len, t.global_batch, t.global_batch, 0, 1, t.seed, True)
    t0 = time.perf_counter()
    for _ in range(steps):
        loader.next_step()
    return steps * t.global_batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="the 4x corpus; the 1x is a quarter")
    ap.add_argument("--work", default="/tmp/shardwise-bench-data")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    big, small = work / "corpus4x.jsonl", work / "corpus1x.jsonl"
    build_corpus(small, int(a.size_gb * 1024 * MB / 4))
    build_corpus(big, int(a.size_gb * 1024 * MB))
    print(f"cores: {len(os.sched_getaffinity(0))}; corpora: {small.stat().st_size / MB:,.0f} MB and "
          f"{big.stat().st_size / MB:,.0f} MB of jsonl", flush=True)
    tok_json = str(ROOT / "shardwise/data/assets/tokenizer.json")
    rows = {}
    for name, env in (("encode_batch, one process (its thread pool)", {}),
                      ("encode_batch, one process, one thread", {"RAYON_NUM_THREADS": "1"})):
        _, peak, out = run_sampled([PY, "-c", BASELINE, str(small), tok_json], env)
        r = json.loads(out.strip().splitlines()[-1])
        rows[name] = (r["tokens"] / r["seconds"], peak)
    results = {}
    for corpus in (small, big):
        out = work / f"prepared-{corpus.stem}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        t, peak, _ = run_sampled(prepare_cmd(corpus, out))
        m = manifest(out, corpus)
        results[corpus.stem] = (m["tokens"] + m["val_tokens"], t, peak, m["shards"])
    tokens, t, peak, _ = results["corpus1x"]
    print("\n1. preparation throughput, 1x corpus (same text)")
    print(f"   {'':48s} {'tokens/s':>12s} {'ratio':>7s}")
    ours = tokens / t
    for name, (rate, _) in rows.items():
        print(f"   {name:48s} {rate:12,.0f} {ours / rate:6.2f}x  <- shardwise prepare / this")
    print(f"   {'shardwise prepare (all cores, end to end)':48s} {ours:12,.0f}")
    print("\n2. peak resident memory of preparation (process tree, sum)")
    for stem, (tokens, t, peak, shards) in results.items():
        size = (small if stem == "corpus1x" else big).stat().st_size
        print(f"   {stem}: {size / MB:8,.0f} MB jsonl, {tokens:,} tokens, {shards} shards, {t:6.1f} s, "
              f"peak {peak / MB:,.0f} MB")
    print("\n3. per-rank resident memory at the first training step, 2 ranks (debug preset)")
    cache = work / "cache"
    first_step("", work / "run-kjv", cache)  # prepares the shipped corpus; the next run is timed
    kjv_t, kjv_mem, _ = first_step("", work / "run-kjv", cache)
    big_t, big_mem, consumed = first_step(str(big), work / "run-big", cache, work / "prepared-corpus4x")
    print(f"   shipped KJV: {', '.join(f'{g * 1024:.0f} MB' for g in kjv_mem)}")
    print(f"   4x corpus:   {', '.join(f'{g * 1024:.0f} MB' for g in big_mem)}")
    print(f"   difference:  {max(abs(a - b) for a, b in zip(kjv_mem, big_mem, strict=True)) * 1024:.0f} MB")
    print("\n4. loader and start-up")
    rate = loader_rate(big, work / "prepared-corpus4x")
    print(f"   loader: {rate:,.0f} sequences/s (debug shape, 8 x 512, document masks, one process); "
          f"training consumes {consumed:,.1f}/s on 2 ranks: {rate / consumed:,.0f}x")
    print(f"   2-step 2-rank run, launch to exit: shipped KJV {kjv_t:.1f} s, prepared 4x corpus "
          f"{big_t:.1f} s")


if __name__ == "__main__":
    main()
