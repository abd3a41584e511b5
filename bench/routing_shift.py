"""Why a step's expert load rose: the step's batch or the model's weights, and which weights moved it.

    shardwise train --config configs/deepseek-debug.toml --training.steps=300 --training.stop_after=50 \\
        --checkpoint.interval=1 --eval.interval=0 --run.dir runs/ds-every
    python bench/routing_shift.py --run runs/ds-every --step 42

(a deepseek-debug checkpoint is about 140 MB: 50 of them take 7 GB). Step N's logged load comes from
the forward of the weights saved after step N-1 (``B``); the step before's (``A``, step N-2) is the
reference. Printed per MoE block, in fp32 on one process:

- the load of ``B`` on step N's own batch (re-read with the run's seed: equal to the logged load);
- its load on ``--batches`` other batches of the same size (median and largest), and on all of them
  at once: a load that rises on every batch alike is the weights', one on the own batch only is
  that batch's content;
- ``A``'s load on those batches, then ``B`` with one group of ``A``'s tensors put back (the routers;
  each block before the worst one; every block's attention, feed-forward, norms; the embedding):
  the group whose return brings the load back is the update that moved the routing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.api import load  # noqa: E402
from shardwise.data.dataset import PackedLoader, open_corpus  # noqa: E402
from shardwise.data.tokenizer import load_tokenizer  # noqa: E402
from shardwise.models.moe import moe_layers  # noqa: E402
from shardwise.resolve.checks import load_config  # noqa: E402


def block_loads(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    """Each MoE block's load (busiest expert's slots over the mean) over ``batches`` together -> (L,)."""
    layers = moe_layers(model)
    counts = torch.zeros(len(layers), layers[0].n_experts)  # (L, E)

    def hook(i: int):  # noqa: ANN202
        def count(_mod, _args, out) -> None:  # noqa: ANN001 -- the router's (weights, ids, scores)
            counts[i] += F.one_hot(out[1].flatten(), counts.shape[1]).sum(0).float()
        return count

    handles = [m.router.register_forward_hook(hook(i)) for i, m in enumerate(layers)]
    with torch.no_grad():
        for x in batches:
            model(x)
    for h in handles:
        h.remove()
    return counts.max(-1).values / counts.mean(-1)


def step_inputs(loader: PackedLoader) -> torch.Tensor:
    return torch.cat([b.inputs for b in loader.next_step()])  # (global batch, S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run trained with --checkpoint.interval=1")
    ap.add_argument("--step", type=int, required=True, help="the step whose logged load rose (>= 3)")
    ap.add_argument("--batches", type=int, default=8, help="other batches of the run's size")
    a = ap.parse_args()
    run = Path(a.run)
    ckpt = run / "checkpoints"
    for n in (a.step - 2, a.step - 1):
        if not (ckpt / f"step-{n}").is_dir():
            raise SystemExit(f"routing_shift: {ckpt / f'step-{n}'} is missing: train the run with "
                             "--checkpoint.interval=1 through step --step - 1")
    cfg = load_config(run / "config.toml", [])
    t = cfg.training
    corpus = open_corpus(cfg.data, load_tokenizer(cfg.data.tokenizer))

    def loader(seed: int) -> PackedLoader:
        return PackedLoader(corpus.train, t.seq_len, t.global_batch, t.global_batch, 0, 1, seed, False,
                            weights=corpus.weights, names=corpus.names)

    own_loader = loader(t.seed)
    for _ in range(a.step - 1):
        own_loader.next_step()
    own = step_inputs(own_loader)
    other_loader = loader(t.seed + 1)
    others = [step_inputs(other_loader) for _ in range(a.batches)]

    model_a = load(ckpt / f"step-{a.step - 2}", dtype="fp32", device="cpu").module.eval()
    model_b = load(ckpt / f"step-{a.step - 1}", dtype="fp32", device="cpu").module.eval()
    blocks = [m.layer_id for m in moe_layers(model_b)]
    rows = [(f"B on step {a.step}'s batch", block_loads(model_b, [own]))]
    each = torch.stack([block_loads(model_b, [x]) for x in others])  # (K, L)
    together = block_loads(model_b, others)
    rows += [(f"B on {a.batches} other batches: median", each.median(0).values),
             ("  largest", each.max(0).values), ("  all at once", together),
             ("A, all at once", block_loads(model_a, others))]
    worst = int(together.argmax())
    state_a, state_b = model_a.state_dict(), {k: v.clone() for k, v in model_b.state_dict().items()}
    below = blocks[worst]
    groups = {"routers": r"\.router\.", **{f"block {i}": rf"^layers\.{i}\." for i in range(below)},
              f"blocks 0-{below - 1} together": rf"^layers\.({'|'.join(map(str, range(below)))})\.",
              "attention (all blocks)": r"\.attention\.", "feed-forward (all)": r"\.feed_forward\.",
              "norms": r"norm\.weight$", "embedding": r"^tok_embeddings\."}
    for name, pattern in groups.items():
        keys = [k for k in state_a if re.search(pattern, k)]
        model_b.load_state_dict({**state_b, **{k: state_a[k] for k in keys}})
        rows.append((f"B with A's {name} ({len(keys)} tensors)", block_loads(model_b, others)))
    width = max(len(r[0]) for r in rows)
    print(f"{'MoE block':{width}s} | " + " | ".join(f"{b:5d}" for b in blocks))
    for name, loads in rows:
        print(f"{name:{width}s} | " + " | ".join(f"{v:5.2f}" for v in loads.tolist()))
    print(f"(the worst block over the other batches: {blocks[worst]})")


if __name__ == "__main__":
    main()
