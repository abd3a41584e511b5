"""What a loss spike is made of: the model before the spiking step, scored on that step's batch.

    python bench/spike.py --run runs/spike --train --steps 19 -- --lr_scheduler.decay constant
    python bench/spike.py --run runs/spike --at 18

``--train`` runs ``shardwise train`` on the debug preset in fp32 with a checkpoint every step (extra
flags after ``--`` go to it). The analysis loads the checkpoint of step ``at - 1``, rebuilds the loader
exactly as the trainer does, takes step ``at``'s batch and reports, per window: its loss, the share of
next-token probability given to tokens that were never a label in steps 1..at-1 ("unseen"), the
largest attention logit and the lowest mean attention entropy over the layers, and the cosine of the
last hidden state with the direction the unseen tokens' output rows moved since initialization.
It also reports the output rows' movement (seen vs unseen) and the input embedding rows' movement.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.data.dataset import PackedLoader, open_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.infer.generate import load_for_generation
from shardwise.models.layers import apply_rope
from shardwise.models.transformer import build_model, init_weights
from shardwise.resolve.checks import load_config

ROOT = Path(__file__).resolve().parents[1]


def train(run: Path, steps: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", "configs/debug.toml", "--run.dir", str(run),
           "--run.overwrite=true", f"--training.steps={steps}", "--training.mixed_precision=fp32",
           "--checkpoint.interval=1", "--eval.interval=0", "--metrics.plot=false",
           "--metrics.tensorboard=false", "--metrics.log_format=line", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True)


def batches(run: Path, upto: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, labels) of global steps 1..upto, as the run's one-rank loader made them."""
    cfg = load_config(str(run / "config.toml"), [])
    corpus = open_corpus(cfg.data, load_tokenizer(cfg.data.tokenizer))
    t = cfg.training
    loader = PackedLoader(corpus.train, t.seq_len, t.global_batch, t.global_batch, 0, 1, t.seed, False,
                          torch.device("cpu"), weights=corpus.weights, names=corpus.names)
    out = []
    for _ in range(upto):
        (b,) = loader.next_step()
        out.append((b.inputs, b.labels))
    return out


def attention_stats(model: torch.nn.Module, tokens: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer (largest pre-softmax logit, lowest per-head mean entropy in nats) over one window."""
    stats: list[tuple[float, float]] = []

    def hook(attn: torch.nn.Module, inputs: tuple, _out: torch.Tensor) -> None:
        x, rope = inputs[0], inputs[1]
        b, s, _ = x.shape
        q = attn.wq(x).view(b, s, -1, attn.head_dim)
        k = attn.wk(x).view(b, s, -1, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        rope = rope[:s] if rope.dim() == 3 else rope
        q, k = (apply_rope(t, rope).transpose(1, 2) for t in (q, k))  # (B, H, S, D)
        logits = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)  # (B, H, S, S)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
        p = logits.softmax(-1)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1).mean(-1)  # (B, H)
        stats.append((float(logits[..., causal].max()), float(ent.min())))

    handles = [layer.attention.register_forward_hook(hook) for layer in model.layers.values()]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return stats


def hidden(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden states (B, S, dim)."""
    out = {}
    handle = model.norm.register_forward_hook(lambda _m, _i, o: out.__setitem__("h", o))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    return out["h"]


def analyse(run: Path, at: int) -> dict:
    data = batches(run, at)
    inputs, labels = data[at - 1]
    seen = torch.zeros(2048, dtype=torch.bool)
    for _, lab in data[:at - 1]:
        seen[lab.flatten()] = True
    model = load_for_generation(checkpoint=str(run / "checkpoints" / f"step-{at - 1}")).model.float()
    init = build_model(model.args).to_empty(device="cpu")
    init_weights(init, load_config(str(run / "config.toml"), []).training.seed)
    w, w0 = model.output.weight.detach(), init.output.weight.detach()
    moved = w - w0  # (V, dim)
    direction = F.normalize(moved[~seen].mean(0), dim=0)
    unseen_dirs = F.normalize(moved[~seen], dim=1)
    rows = {"seen tokens": int(seen.sum()), "unseen tokens": int((~seen).sum()),
            "output row move, seen (mean L2)": float(moved[seen].norm(dim=1).mean()),
            "output row move, unseen (mean L2)": float(moved[~seen].norm(dim=1).mean()),
            "output row at init (mean L2)": float(w0.norm(dim=1).mean()),
            "unseen moves' mean cosine with their mean": float((unseen_dirs @ direction).mean()),
            "embedding row move, seen inputs (mean L2)": float(
                (model.tok_embeddings.weight - init.tok_embeddings.weight)[seen].norm(dim=1).mean())}
    windows = []
    with torch.no_grad():
        logits = model(inputs)  # (B, S, V)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)
        p_unseen = logits.softmax(-1)[..., ~seen].sum(-1).mean(1)
        h = hidden(model, inputs)
        cos = (F.normalize(h, dim=-1) @ direction).mean(1)
        lse = logits.logsumexp(-1).mean(1)
    for i in range(inputs.shape[0]):
        st = attention_stats(model, inputs[i:i + 1])
        windows.append({"window": i, "loss": round(float(losses[i]), 3),
                        "p(unseen)": round(float(p_unseen[i]), 3),
                        "cos(h, unseen move)": round(float(cos[i]), 3),
                        "mean logsumexp": round(float(lse[i]), 2),
                        "max attention logit": round(max(a for a, _ in st), 2),
                        "min head entropy": round(min(e for _, e in st), 3)})
    return {"at": at, "rows": rows, "windows": windows,
            "batch loss": round(float(F.cross_entropy(logits.flatten(0, 1), labels.flatten())), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--train", action="store_true")
    p.add_argument("--steps", type=int, default=19)
    p.add_argument("--at", type=int, default=18)
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    run = Path(a.run)
    if a.train:
        train(run, a.steps, a.extra)
    print(json.dumps(analyse(run, a.at), indent=1))


if __name__ == "__main__":
    main()
