"""Independent references the tests compare shardwise against: a training step written out on Hugging
Face's Llama (:class:`Reference`), and the plain cross-entropy runs the fused loss is held to."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.checkpoint.hf import hf_config, to_hf_state
from shardwise.data.dataset import IGNORE_INDEX
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.tensor import full_value
from shardwise.resolve.checks import load_config
from shardwise.resolve.run import resolve_run
from shardwise.trainer.build import build_rank_model
from shardwise.trainer.session import build_data
from tests.helpers import ROOT, require

STEPS = 3


PEAK_LR, WARMUP, WD, BETAS, EPS, MAX_NORM = 3e-3, 2, 0.1, (0.9, 0.95), 1e-8, 0.25


def hf_params(model: torch.nn.Module, args) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return to_hf_state({k: full_value(v).detach().clone() for k, v in model.state_dict().items()}, args)


HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM"}


def fused_experts(state: dict[str, torch.Tensor],
                  hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (per-expert keys, as a saved folder holds them) in the in-memory layout of transformers
    5's MoE models where ``hf_state`` has it: ``mlp.experts.gate_up_proj`` (E, 2h, d) and
    ``mlp.experts.down_proj`` (E, d, h)."""
    out = dict(state)
    for key in (k for k in hf_state if k.endswith("mlp.experts.gate_up_proj")):
        prefix = key[: -len(".gate_up_proj")]
        n = hf_state[key].shape[0]
        take = [{w: out.pop(f"{prefix}.{e}.{w}_proj.weight") for w in ("gate", "up", "down")}
                for e in range(n)]
        out[key] = torch.stack([torch.cat([t["gate"], t["up"]]) for t in take])  # (E, 2h, d)
        out[f"{prefix}.down_proj"] = torch.stack([t["down"] for t in take])  # (E, d, h)
    return out


class Reference:
    """Hugging Face's model of the same family (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3) with the
    trainer's initial weights, and a training step written out. An MoE model's routing is recorded:
    ``loads[step - 1]`` is each MoE block's busiest expert's slots over the mean, in block order."""

    def __init__(self, model: torch.nn.Module, args, min_lr_ratio: float,  # noqa: ANN001
                 steps: int = STEPS) -> None:
        transformers = require("transformers")
        params = hf_params(model, args)
        config = hf_config(args, "fp32")
        hf_class = getattr(transformers, HF_CLASSES[config["model_type"]])
        self.hf = hf_class(transformers.AutoConfig.for_model(**config))
        self.hf.to(next(iter(params.values())).device)
        state = fused_experts(params, self.hf.state_dict())
        missing, unexpected = self.hf.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("e_score_correction_bias") for k in missing), missing
        self.start = {k: v.detach().clone() for k, v in self.hf.named_parameters()}
        self.moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in self.hf.named_parameters()}
        self.min_lr_ratio, self.steps = min_lr_ratio, steps
        self.n_experts, self.counts, self.loads = args.n_experts, [], []
        for name, m in self.hf.named_modules():
            if name.endswith("mlp.gate"):  # (router logits, weights, expert ids (T, k))
                m.register_forward_hook(lambda _m, _i, out: self.counts.append(
                    torch.bincount(out[2].flatten(), minlength=self.n_experts).double()))

    def step(self, batches: list, step: int) -> tuple[float, float, float, float]:
        """(loss, grad norm, lr, clip coefficient) of optimizer step ``step`` on ``batches``."""
        # Loss: the mean over every valid label of the whole global batch, in one forward.
        inputs = torch.cat([b.inputs for b in batches])  # (8, 64)
        labels = torch.cat([b.labels for b in batches])
        self.counts.clear()
        logits = self.hf(inputs).logits.float()  # (8, 64, V)
        if self.counts:
            self.loads.append([float(c.max() / c.mean()) for c in self.counts])
        n_valid = (labels != IGNORE_INDEX).sum()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / n_valid
        self.hf.zero_grad()
        loss.backward()
        with torch.no_grad():
            norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in self.hf.parameters()))
            coef = min(1.0, MAX_NORM / (norm + 1e-6))
            lr = PEAK_LR * step / WARMUP  # linear warmup, then cosine down to min_lr_ratio
            if step > WARMUP:
                shape = 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (self.steps - WARMUP)))
                lr = PEAK_LR * (self.min_lr_ratio + (1 - self.min_lr_ratio) * shape)
            for name, p in self.hf.named_parameters():  # AdamW, decoupled decay on matrices only
                g = p.grad * coef
                m, v = self.moments[name]
                m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                if p.dim() >= 2:
                    p.mul_(1 - lr * WD)
                m_hat, v_hat = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
                p.sub_(lr * m_hat / (v_hat.sqrt() + EPS))
        return float(loss), norm, lr, coef


def step_trainer(data_cache: str, loss: str = "auto", device: str = "cpu", precision: str = "fp32",  # noqa: ANN201
                 one_rank: str = "auto", model: tuple[str, ...] = (), steps: int = STEPS):
    """The trainer's own pieces on one rank: model, optimizer, schedule, data (inside one_rank_pg,
    or a one-rank NCCL group on a GPU). ``one_rank``: parallel.one_rank; ``model``: more overrides."""
    cfg = load_config(ROOT / "configs" / "debug.toml", [
        "--model.qk_norm=false",  # (a Llama: the reference is HF Llama)
        "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.multiple_of=16", "--training.seq_len=64", "--training.global_batch=8",
        "--training.micro_batch=2",  # 4 accumulated micro-batches: the normalization spans them
        f"--training.mixed_precision={precision}", f"--training.steps={steps}",
        f"--training.max_grad_norm={MAX_NORM}", f"--optimizer.lr={PEAK_LR}", f"--optimizer.weight_decay={WD}",
        f"--lr_scheduler.warmup_steps={WARMUP}", f"--data.cache_dir={data_cache}",
        "--debug.deterministic=true", f"--training.loss={loss}", f"--run.device={device}",
        f"--parallel.one_rank={one_rank}", *model])
    run = resolve_run(cfg, 1)
    run.dims.build_mesh(device)
    model = build_rank_model(run, device)
    optimizer = build_optimizer(model, cfg.optimizer, device, run.model.moe_router_lr_scale)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, steps)
    loader, _ = build_data(run, torch.device(device))
    return cfg, run.model, run, model, optimizer, scheduler, loader


IGNORE = -100


def loss_inputs(dtype: torch.dtype, n: int = 50, d: int = 32, v: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, n // 2, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (2, n // 2), generator=g)
    labels[0, :3] = IGNORE  # ignored tokens, including a run at the start
    labels[1, -1] = IGNORE
    return hidden, weight, labels


def run_loss(fn, hidden, weight, labels, reduction, **kw):  # noqa: ANN001, ANN201
    """(loss, d hidden, d weight) with a random upstream gradient for ``none``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels, reduction=reduction, ignore_index=IGNORE, **kw)
    upstream = torch.ones(loss.shape, dtype=loss.dtype, device=loss.device)
    if reduction == "none":
        upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(loss)
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad


AMP_MOE = ("--model.n_experts=4", "--model.moe_top_k=2", "--model.moe_hidden_dim=32",
           "--model.n_shared_experts=1")
"""Overrides that make step_trainer's model an MoE (shared expert, top-2 of 4)."""


def check_torch_amp(data_cache: str, model: tuple[str, ...], device: str) -> None:
    """parallel.one_rank = plain under bf16 against the same model (a copy without the trainer's hooks,
    its own casts kept: the bf16 residual stream, the experts') under ``torch.autocast`` (bf16) with
    the clip and fused AdamW written out by hand -- fp32 parameters and gradients: loss and norm to
    1e-6 / 1e-5, every parameter to 1e-7, over STEPS steps with accumulation and clipping; the plain
    loss on both sides (the fused loss's casts under autocast: tests/unit/test_chunked_ce.py). Inside
    a one-rank process group."""
    import copy

    from shardwise.optim.clip import clip_divisor
    from shardwise.trainer.loss import TokenLoss, token_loss_sum
    from shardwise.trainer.train import train_step

    cfg, _, run, m, optimizer, scheduler, loader = step_trainer(
        data_cache, "plain", device=device, precision="bf16", one_rank="plain", model=model)
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in m.parameters())
    hand = copy.deepcopy(m)
    for hooks in (hand._forward_pre_hooks, hand._forward_hooks, hand._forward_hooks_always_called):
        hooks.clear()  # the plain module: no autocast hooks (the loop below enters autocast itself)
    wd = cfg.optimizer.weight_decay
    groups = [{"params": [p for p in hand.parameters() if p.dim() >= 2], "weight_decay": wd},
              {"params": [p for p in hand.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    hand_opt = type(optimizer)(groups, lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                               eps=cfg.optimizer.eps, fused=True)
    hand_sched = type(scheduler)(hand_opt, scheduler.lr_lambdas)
    loss = TokenLoss(run.loss_chunk)
    for step in range(STEPS):
        batches = loader.next_step()
        got = train_step(m, optimizer, scheduler, batches, run, loss)
        n_valid = sum(b.n_valid for b in batches)
        total = 0.0
        for b in batches:
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = hand(b.inputs)
            part = token_loss_sum(logits, b.labels)
            (part / n_valid).backward()
            total += float(part)
        grads = [p.grad for p in hand.parameters() if p.grad is not None]
        norm = torch.stack([g.double().norm() for g in grads]).norm().float()
        torch._foreach_div_(grads, clip_divisor(norm, cfg.training.max_grad_norm))
        hand_opt.step()
        hand_sched.step()
        hand_opt.zero_grad(set_to_none=True)
        assert float(got.loss) == pytest.approx(total / n_valid, rel=1e-6), step
        assert float(got.grad_norm) == pytest.approx(float(norm), rel=1e-5), step
    for (name, p), q in zip(m.named_parameters(), hand.parameters(), strict=True):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-7, msg=name)
    assert {p.grad for p in m.parameters()} == {None}
