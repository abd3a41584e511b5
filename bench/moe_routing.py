"""Why an MoE preset's routing collapses: each block's expert load step by step, the router logits'
spread over the experts, and how far one optimizer step moves them -- beside Hugging Face's
Qwen3-MoE trained the same way (same weights, batches, learning rate, AdamW and clipping).

    python bench/moe_routing.py --steps 30                       # the Qwen3-MoE shape of moe-debug
    python bench/moe_routing.py --steps 30 -- --model.moe_balance=aux_loss --model.moe_aux_coef=0.01

Runs on one rank in fp32 from ``configs/moe-debug.toml`` made Qwen3-MoE-shaped (QK-norm, no shared
expert; block 0 dense, as the preset) with routing balanced by nothing unless the extra flags (after
``--``) say so; HF's side has no balancing (its aux loss pools every block and is not shardwise's).
Per step and block: ``load`` (busiest expert's slots over the mean; shardwise / HF), ``spread`` (the
router logits' standard deviation over the experts, mean over tokens) and ``shift`` (how far the
step's update moved each expert's logit on the step's own tokens, averaged over the tokens: the
standard deviation over experts -- a shift near the spread re-orders the experts for every token at
once) and ``alike`` (how much the router's input tokens point the same way: the mean cosine over
all pairs of them, ``|mean of the unit vectors|^2``; 0 for unrelated tokens, 1 when every token is
the same vector -- which a token-choice router, whatever its weights, bias or loss, sends to the
same experts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.checkpoint.hf import hf_config  # noqa: E402
from shardwise.data.dataset import IGNORE_INDEX  # noqa: E402
from shardwise.models.moe import moe_layers  # noqa: E402
from shardwise.optim.adamw import build_optimizer  # noqa: E402
from shardwise.optim.lr import build_lr_scheduler  # noqa: E402
from shardwise.parallel.tensor import full_value  # noqa: E402
from shardwise.resolve.checks import load_config  # noqa: E402
from shardwise.resolve.run import resolve_run  # noqa: E402
from shardwise.trainer.build import build_rank_model  # noqa: E402
from shardwise.trainer.loss import TokenLoss  # noqa: E402
from shardwise.trainer.session import build_data  # noqa: E402
from shardwise.trainer.train import train_step  # noqa: E402
from tests.helpers import one_rank_pg  # noqa: E402  (a one-rank gloo group: FSDP needs one)
from tests.references import fused_experts, hf_params  # noqa: E402

# (the router initialized as the default, 0.02, which docs/models.md's figures describe: the preset
# now starts it wider)
QWEN3_SHAPE = ["--model.qk_norm=true", "--model.n_shared_experts=0", "--model.moe_balance=none",
               "--model.moe_router_init_std=0.02"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-hf", action="store_true", help="shardwise only (any MoE shape)")
    ap.add_argument("extra", nargs="*", help="config overrides (after --)")
    a = ap.parse_args()
    over = [f"--training.steps={a.steps}", "--training.mixed_precision=fp32", "--debug.deterministic=true",
            *([] if a.no_hf else QWEN3_SHAPE), *a.extra]
    cfg = load_config(ROOT / "configs" / "moe-debug.toml", over)
    with one_rank_pg():
        run = resolve_run(cfg, 1)
        run.dims.build_mesh("cpu")
        model = build_rank_model(run, "cpu")
        optimizer = build_optimizer(model, cfg.optimizer, "cpu")
        scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, a.steps)
        loader, _ = build_data(run, torch.device("cpu"))
        hf = None if a.no_hf else HFTwin(model, run, cfg)
        inputs: dict[int, list[torch.Tensor]] = {}
        for m in moe_layers(model):  # the router's input tokens of the step (every micro-batch)
            m.router.register_forward_hook(lambda mod, args, _out, i=m.layer_id: inputs[i].append(
                args[0].detach().float()))
        print(f"model {cfg.model.name}: {run.model.n_experts} experts, top-{run.model.moe_top_k}, "
              f"balance {run.model.moe_balance}; lr {cfg.optimizer.lr:g}, "
              f"warmup {cfg.lr_scheduler.warmup_steps}")
        print("step | lr | loss (shardwise / HF) | per MoE block: load shardwise/HF, spread, shift, alike")
        for step in range(1, a.steps + 1):
            batches = loader.next_step()
            lr = optimizer.param_groups[0]["lr"]
            for m in moe_layers(model):
                inputs[m.layer_id] = []
            before = {m.layer_id: full_value(m.router.gate.weight).detach().clone()
                      for m in moe_layers(model)}
            got = train_step(model, optimizer, scheduler, batches, run, TokenLoss(run.loss_chunk))
            hf_loss, hf_loads = hf.step(batches, lr) if hf else (float("nan"), [])
            cells = []
            for j, m in enumerate(moe_layers(model)):
                x = torch.cat(inputs[m.layer_id])  # (T, dim)
                w0, w1 = before[m.layer_id], full_value(m.router.gate.weight).detach()
                spread = (x @ w0.T).std(-1).mean()
                shift = (x @ (w1 - w0).T).mean(0).std()  # (E,) mean shift per expert -> its spread
                alike = F.normalize(x, dim=-1).mean(0).square().sum()  # mean pairwise cosine
                theirs = f"/{hf_loads[j]:.2f}" if hf_loads else ""
                cells.append(f"{float(got.expert_load[j]):.2f}{theirs} {spread:.3f} {shift:.3f} {alike:.2f}")
            print(f"{step:3d} | {lr:.2e} | {float(got.loss):.4f} / {hf_loss:.4f} | " + " | ".join(cells),
                  flush=True)


class HFTwin:
    """HF's model of the run's shape with its initial weights, trained by torch's AdamW (decay on
    matrices only) with global-norm clipping at the learning rate shardwise's step used."""

    def __init__(self, model: torch.nn.Module, run, cfg) -> None:  # noqa: ANN001
        import transformers

        config = hf_config(run.model, "fp32")
        self.model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.for_model(**config))
        self.model.load_state_dict(fused_experts(hf_params(model, run.model), self.model.state_dict()))
        params = list(self.model.parameters())
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.max_norm, self.n_experts, self.counts = cfg.training.max_grad_norm, run.model.n_experts, []
        for name, m in self.model.named_modules():
            if name.endswith("mlp.gate"):  # (router logits, weights, expert ids (T, k))
                m.register_forward_hook(lambda _m, _i, out: self.counts.append(
                    torch.bincount(out[2].flatten(), minlength=self.n_experts).double()))

    def step(self, batches: list, lr: float) -> tuple[float, list[float]]:
        inputs = torch.cat([b.inputs for b in batches])
        labels = torch.cat([b.labels for b in batches])
        self.counts.clear()
        logits = self.model(inputs).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        return float(loss), [float(c.max() / c.mean()) for c in self.counts]


if __name__ == "__main__":
    main()
