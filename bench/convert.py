"""Time and peak host memory of `shardwise convert` both ways, for a real model shape with random
weights (no download): a weights-only checkpoint of the preset is written first, then exported to a
Hugging Face folder (bf16) and imported back, each conversion in a fresh process whose peak resident
memory is read from the kernel (ru_maxrss).

    python bench/convert.py                 # 1b (Llama 3.2 1B's shape)
    python bench/convert.py --preset qwen3-0.6b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def seed_checkpoint(preset: str, out: Path) -> int:
    """A weights-only checkpoint of ``preset`` with random weights (fp32); its parameter count."""
    from shardwise.checkpoint import save_model_only
    from shardwise.config.schema import ModelConfig
    from shardwise.models import PRESETS
    from shardwise.models.transformer import build_model, init_weights

    args = PRESETS[preset]
    model = build_model(args, device="cpu")
    init_weights(model, 0)
    save_model_only(out, {k: v.detach() for k, v in model.state_dict().items()},
                    {"model": dataclasses.asdict(ModelConfig(name=preset))})
    return sum(p.numel() for p in model.parameters())


# The CLI in this process, then its own peak resident memory (KiB) as the last line of stderr. From
# /proc (VmHWM, this image's own peak): getrusage's ru_maxrss would carry the forking parent's.
_RUN = ("import runpy, sys\n"
        "sys.argv = ['shardwise', 'convert', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('shardwise', run_name='__main__')\n"
        "finally:\n    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "    print(hwm.split()[1], file=sys.stderr)\n")


def child(argv: list[str]) -> dict[str, float]:
    """Run ``shardwise convert argv`` in a fresh process: wall seconds and its peak RSS in GiB."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return {"s": wall, "peak_gib": int(proc.stderr.strip().splitlines()[-1]) / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        n = seed_checkpoint(a.preset, d / "ckpt")
        size = sum(f.stat().st_size for f in (d / "ckpt").iterdir()) / 2**30
        export = child(["--to-hf", str(d / "ckpt"), "--out", str(d / "hf"), "--dtype", "bf16"])
        hf_size = sum(f.stat().st_size for f in (d / "hf").glob("*.safetensors")) / 2**30
        back = child(["--from-hf", str(d / "hf"), "--out", str(d / "back" / "step-0")])
        print(json.dumps({"preset": a.preset, "params": n, "checkpoint_gib": size, "hf_gib": hf_size,
                          "export": export, "import": back}))
        print("\n| preset | parameters | direction | files | wall s | peak RSS GiB |")
        print("|---|---|---|---|---|---|")
        print(f"| {a.preset} | {n / 1e9:.2f}B | export (checkpoint -> HF bf16) | {hf_size:.2f} GiB | "
              f"{export['s']:.1f} | {export['peak_gib']:.2f} |")
        print(f"| {a.preset} | {n / 1e9:.2f}B | import (HF bf16 -> checkpoint fp32) | {size:.2f} GiB | "
              f"{back['s']:.1f} | {back['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
