"""LR schedules against their formulas; global-norm clipping against torch's on plain tensors."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.config.schema import LRSchedulerConfig, OptimizerConfig
from shardwise.models.transformer import RMSNorm
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.clip import clip_grad_norm_
from shardwise.optim.lr import WarmupDecay


def test_warmup_then_cosine():
    f = WarmupDecay(LRSchedulerConfig(warmup_steps=10, decay="cosine", min_lr_ratio=0.1), 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(59) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(109) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = WarmupDecay(LRSchedulerConfig(warmup_steps=0, decay="linear", min_lr_ratio=0.0), 100)
    assert lin(49) == pytest.approx(0.5) and lin(99) == pytest.approx(0.0)
    const = WarmupDecay(LRSchedulerConfig(warmup_steps=5, decay="constant"), 100)
    assert const(2) == pytest.approx(0.6) and const(80) == 1.0


def test_warmup_stable_decay():
    f = WarmupDecay(LRSchedulerConfig(warmup_steps=10, decay="wsd", decay_fraction=0.2,
                                      min_lr_ratio=0.0), 100)
    assert f(50) == 1.0 and f(79) == 1.0  # stable until the last 20 steps
    assert f(89) == pytest.approx(0.5) and f(99) == pytest.approx(0.0)


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_matches_torch(max_norm: float):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
    ours = clip_grad_norm_(a, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm)
    torch.testing.assert_close(ours, ref)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_folded_into_fused_adamw_is_the_same_update():
    """The clip's division inside fused AdamW's kernel (optimizer.grad_scale) gives the parameters
    the explicit in-place clip gives, bit for bit; clipping really happens (max_norm binds), and
    the scale does not leak into the next step."""
    from shardwise.optim.clip import folds_grad_scale

    def run(fold: bool | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2), "cpu")
        assert folds_grad_scale(opt)
        x = torch.randn(8, 16)
        for step in range(3):
            (model(x * (step + 1)) ** 2).sum().backward()
            if fold is not None:
                norm = clip_grad_norm_(model.parameters(), 0.5, optimizer=opt if fold else None)
                assert norm > 0.5  # (the clip binds)
            opt.step()
            opt.__dict__.pop("grad_scale", None)
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    folded, explicit, unclipped = run(True), run(False), run(None)
    assert all(torch.equal(a, b) for a, b in zip(folded, explicit, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(folded, unclipped, strict=True))


def test_weight_decay_skips_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), RMSNorm(4, 1e-5))
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2} and {p.dim() for p in no_decay["params"]} == {1}
    assert opt.defaults.get("fused") is True
