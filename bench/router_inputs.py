"""How alike an MoE model's router inputs are, and which sublayer makes them so.

    shardwise train --config configs/deepseek-debug.toml --training.steps=300 --training.stop_after=21 \\
        --checkpoint.interval=7 --eval.interval=0 --run.dir runs/ds-alike
    python bench/router_inputs.py --run runs/ds-alike --steps 7 14 21

When every token's router input points the same way, the routing of all of them turns on the same
few score differences, and one step's shift sends them to the same experts together (docs/models.md,
"Keeping MoE balanced"). For each saved step, in fp32 on one process over the run's first batch:

- per MoE block, ``alike``: the norm of the router inputs' mean over the tokens divided by their mean
  norm (0 = no shared direction; 1 = every token the same vector);
- the parts of the residual stream at the last MoE block's router (the embedding, then each block's
  attention and feed-forward output): each part's token mean projected on the residual's mean
  direction, then the part's mean norm. A part whose projection is close to its size hands every
  token the same vector. The residual is read where the block reads it (its ``ffn_norm``'s input),
  apart from the parts: ``unexplained`` is how far its mean is from the parts' means summed (0 when
  the parts are the whole residual, as in these models).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.api import load  # noqa: E402
from shardwise.data.dataset import PackedLoader, open_corpus  # noqa: E402
from shardwise.data.tokenizer import load_tokenizer  # noqa: E402
from shardwise.models.moe import moe_layers  # noqa: E402
from shardwise.resolve.checks import load_config  # noqa: E402


def alike(x: torch.Tensor) -> float:
    """(T, dim) -> |mean over tokens| / mean |token|."""
    return float(x.mean(0).norm() / x.norm(dim=-1).mean().clamp(min=1e-12))


@torch.no_grad()
def router_inputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    """``tokens`` (B, S) through ``model`` -> {"alike": {block: value}, "parts": [(name, projection,
    size)], "residual": norm of the residual's token mean at the last MoE block's feed-forward input,
    "unexplained": norm of that mean minus the parts' means summed}."""
    inputs: dict[int, torch.Tensor] = {}
    parts: list[tuple[str, torch.Tensor]] = []
    residual: list[torch.Tensor] = []
    handles = [model.tok_embeddings.register_forward_hook(
        lambda _m, _a, out: parts.append(("embedding", out)))]
    layers = moe_layers(model)
    for m in layers:
        handles.append(m.router.register_forward_hook(
            lambda _m, args, _out, i=m.layer_id: inputs.__setitem__(i, args[0].float())))
    last = max(m.layer_id for m in layers)
    handles.append(model.layers[str(last)].ffn_norm.register_forward_hook(
        lambda _m, args, _out: residual.append(args[0])))
    for i, block in model.layers.items():
        if int(i) > last:
            break
        handles.append(block.attention.register_forward_hook(
            lambda _m, _a, out, i=i: parts.append((f"attention {i}", out))))
        if int(i) < last:  # the last MoE block's own output is not part of its input
            handles.append(block.feed_forward.register_forward_hook(
                lambda _m, _a, out, i=i: parts.append((f"feed-forward {i}", out))))
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    flat = [(name, out.reshape(-1, out.shape[-1]).float()) for name, out in parts]  # (T, dim) each
    mean = residual[0].reshape(-1, residual[0].shape[-1]).float().mean(0)  # (dim,)
    direction = mean / mean.norm().clamp(min=1e-12)
    return {"alike": {i: alike(x) for i, x in sorted(inputs.items())},
            "parts": [(name, float(out.mean(0) @ direction), float(out.norm(dim=-1).mean()))
                      for name, out in flat],
            "residual": float(mean.norm()),
            "unexplained": float((mean - sum(out.mean(0) for _, out in flat)).norm())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run directory with checkpoints/step-N")
    ap.add_argument("--steps", type=int, nargs="+", required=True, help="saved steps to read")
    a = ap.parse_args()
    run = Path(a.run)
    cfg = load_config(run / "config.toml", [])
    t = cfg.training
    corpus = open_corpus(cfg.data, load_tokenizer(cfg.data.tokenizer))
    loader = PackedLoader(corpus.train, t.seq_len, t.global_batch, t.global_batch, 0, 1, t.seed, False,
                          weights=corpus.weights, names=corpus.names)
    tokens = torch.cat([b.inputs for b in loader.next_step()])  # (global batch, S)
    for step in a.steps:
        path = run / "checkpoints" / f"step-{step}"
        if not path.is_dir():
            raise SystemExit(f"router_inputs: {path} is missing: save the run at step {step}")
        model = load(path, dtype="fp32", device="cpu").module.eval()
        if not moe_layers(model):
            raise SystemExit(f"router_inputs: {path} holds no MoE block")
        r = router_inputs(model, tokens)
        print(f"step {step}: router inputs alike, by block: "
              + "  ".join(f"{i}: {v:.2f}" for i, v in r["alike"].items()))
        print(f"  residual mean {r['residual']:.2f} ({r['unexplained']:.1e} not in the parts); "
              "parts (projection / size): "
              + ", ".join(f"{n} {p:+.2f} / {s:.2f}" for n, p, s in r["parts"]))


if __name__ == "__main__":
    main()
