"""What a loss spike is made of: the model before the spiking step, scored on that step's batch.

    python bench/spike.py --run runs/spike --train --steps 19 -- --lr_scheduler.decay constant
    python bench/spike.py --run runs/spike --at 18
    python bench/spike.py --run runs/spike --at 11-30       # one line per step
    python bench/spike.py --run runs/ds --train --steps 13 -- --model.name=deepseek-debug \
        --model.qk_norm=false --lr_scheduler.decay=constant
    python bench/spike.py --run runs/ds --at 13 --localize  # which parameters' update spiked it

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
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.data.dataset import PackedLoader, open_corpus
from shardwise.data.tokenizer import load_tokenizer
from shardwise.infer.generate import load_for_generation
from shardwise.models.transformer import build_model, init_weights
from shardwise.observe.attention import attention_stats
from shardwise.resolve.checks import load_config

ROOT = Path(__file__).resolve().parents[1]


def train(run: Path, steps: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", "configs/debug.toml",
           "--run.dir", str(run), "--run.overwrite=true", f"--training.steps={steps}",
           "--training.mixed_precision=fp32",
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
                (model.tok_embeddings.weight - init.tok_embeddings.weight).detach()[seen].norm(dim=1).mean())}
    windows = []
    with torch.no_grad():
        logits = model(inputs)  # (B, S, V)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)
        p_unseen = logits.softmax(-1)[..., ~seen].sum(-1).mean(1)
        h = hidden(model, inputs)
        cos = (F.normalize(h, dim=-1) @ direction).mean(1)
        lse = logits.logsumexp(-1).mean(1)
    for i in range(inputs.shape[0]):
        st = [(a.max_logit, a.min_entropy) for a in attention_stats(model, inputs[i:i + 1])]
        windows.append({"window": i, "loss": round(float(losses[i]), 3),
                        "p(unseen)": round(float(p_unseen[i]), 3),
                        "cos(h, unseen move)": round(float(cos[i]), 3),
                        "mean logsumexp": round(float(lse[i]), 2),
                        "max attention logit": round(max(a for a, _ in st), 2),
                        "min head entropy": round(min(e for _, e in st), 3)})
    return {"at": at, "rows": rows, "windows": windows,
            "batch loss": round(float(F.cross_entropy(logits.flatten(0, 1), labels.flatten())), 4)}


def localize(run: Path, at: int) -> dict:
    """Which part of step ``at - 1``'s update makes step ``at``'s batch spike: the batch loss of the
    step ``at - 1`` model with one part of its parameters set back to their step ``at - 2`` values --
    each block's attention, feed-forward (experts, router, shared expert) and norms, the embedding
    and the output head -- and with all attention but one block's set back; the blocks' attention
    output norms (mean over positions) before and after; and, for an MoE model, the loss with the
    step ``at - 2`` model's routing replayed (whether the re-route is the cause) and the share of
    tokens the two models send to the same experts. Per block before and after: the attention
    output norms, the largest attention logit and the lowest head entropy."""
    from shardwise.models.moe import moe_layers

    inputs, labels = batches(run, at)[at - 1]
    before, after = (load_for_generation(checkpoint=str(run / "checkpoints" / f"step-{s}")).model.float()
                     for s in (at - 2, at - 1))
    old, new = before.state_dict(), {k: v.clone() for k, v in after.state_dict().items()}

    def loss(back: object = None) -> float:  # ``back(name)``: set that parameter back
        after.load_state_dict({k: old[k] if back and back(k) else v for k, v in new.items()})
        with torch.no_grad():
            return round(float(F.cross_entropy(after(inputs).flatten(0, 1), labels.flatten())), 3)

    blocks = sorted({int(k.split(".")[1]) for k in new if k.startswith("layers.")})
    parts = {"embedding": lambda k: k.startswith("tok_embeddings"),
             "output": lambda k: k.startswith("output")}
    for i in blocks:
        for part in ("attention", "feed_forward"):
            parts[f"block {i} {part}"] = lambda k, i=i, p=part: k.startswith(f"layers.{i}.{p}.")
        parts[f"block {i} norms"] = lambda k, i=i: k.startswith(f"layers.{i}.") and k.split(".")[2].endswith(
            "_norm")
        parts[f"all attention but block {i}"] = lambda k, i=i: ".attention." in k and not k.startswith(
            f"layers.{i}.")
    out = {"loss before": loss(lambda k: True), "loss after": loss(),
           "set back": dict(sorted(((n, loss(f)) for n, f in parts.items()), key=lambda x: x[1]))}
    after.load_state_dict(new)
    norms = {}
    for name, model in (("before", before), ("after", after)):
        got: dict[int, float] = {}
        hooks = [model.layers[str(i)].attention.register_forward_hook(
            lambda _m, _i, o, i=i, got=got: got.__setitem__(i, round(float(o.norm(dim=-1).mean()), 2)))
            for i in blocks]
        with torch.no_grad():
            model(inputs)
        for h in hooks:
            h.remove()
        norms[name] = got
    out["attention output norm"] = norms
    for name, model in (("before", before), ("after", after)):  # per block: largest logit, lowest entropy
        out[f"attention by block, {name}"] = [(round(a.max_logit, 2), round(a.min_entropy, 2))
                                              for a in attention_stats(model, inputs)]
    if moe_layers(after):  # replay the earlier model's routing (a training forward: routing hooks run)
        class Trace:
            def __init__(self, ids: dict | None = None) -> None:
                self.ids, self.replay = ids or {}, ids is not None

            def choose(self, moe: torch.nn.Module, _biased: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
                if self.replay:
                    return self.ids[moe.layer_id]
                self.ids[moe.layer_id] = ids
                return ids

        def routed(model: torch.nn.Module, trace: Trace) -> float:
            for m in moe_layers(model):
                m.routing, m.count_tokens = trace, True
            model.train()
            with torch.enable_grad():
                value = float(F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).detach())
            for m in moe_layers(model):
                m.routing = None
            return round(value, 3)

        first, second = Trace(), Trace()
        routed(before, first)
        routed(after, second)
        out["tokens keeping both experts, by block"] = {
            b: round(float((first.ids[b].sort(-1).values == second.ids[b].sort(-1).values).all(-1)
                           .float().mean()), 3) for b in first.ids}
        out["loss after, routed as before"] = routed(after, Trace(first.ids))
    return out


def summary(report: dict) -> dict:
    """One line of :func:`analyse`: the step's worst window by each measure."""
    w, rows = report["windows"], report["rows"]
    return {"at": report["at"], "batch loss": report["batch loss"],
            "worst window loss": max(x["loss"] for x in w),
            "max p(unseen)": max(x["p(unseen)"] for x in w),
            "max cos(h, unseen move)": max(x["cos(h, unseen move)"] for x in w),
            "unseen move": round(rows["output row move, unseen (mean L2)"], 3),
            "max attention logit": max(x["max attention logit"] for x in w)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--train", action="store_true")
    p.add_argument("--steps", type=int, default=19)
    p.add_argument("--at", default="18", help="a step, or FIRST-LAST for one summary line per step")
    p.add_argument("--localize", action="store_true", help="which part of the update made step --at spike")
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    run = Path(a.run)
    if a.train:
        train(run, a.steps, a.extra)
    if a.localize:
        print(json.dumps(localize(run, int(a.at)), indent=1))
        return
    if "-" in a.at:
        first, last = map(int, a.at.split("-"))
        for at in range(first, last + 1):
            print(json.dumps(summary(analyse(run, at))), flush=True)
    else:
        print(json.dumps(analyse(run, int(a.at)), indent=1))


if __name__ == "__main__":
    main()
