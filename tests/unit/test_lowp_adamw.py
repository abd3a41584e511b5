"""BF16-state AdamW against torch's fp32 AdamW: the first step equal, later steps equal to fp32 AdamW
whose moments are rounded to bf16 after every step, master weights, checkpoint round trip."""

from __future__ import annotations

import pytest
import torch

from shardwise.config.schema import OptimizerConfig
from shardwise.optim.adamw import LowPrecisionAdamW, build_optimizer, state_bytes_per_param

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(33, 17), (64,), (5, 3, 4)]]


def set_grads(ps: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def test_first_step_equals_fp32_adamw():
    ours, ref = params(), params()
    opt, ref_opt = LowPrecisionAdamW(ours, **HYPER), torch.optim.AdamW(ref, foreach=False, **HYPER)
    set_grads(ours, 0), set_grads(ref, 0)
    opt.step(), ref_opt.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    assert {opt.state[p]["exp_avg"].dtype for p in ours} == {torch.bfloat16}
    assert {opt.state[p]["exp_avg_sq"].dtype for p in ours} == {torch.bfloat16}


def test_steps_equal_fp32_math_on_bf16_rounded_moments():
    """The update is fp32 AdamW's, applied to moments that are stored rounded to bf16."""
    ours, ref = params(), params()
    opt, ref_opt = LowPrecisionAdamW(ours, **HYPER), torch.optim.AdamW(ref, foreach=False, **HYPER)
    for step in range(20):
        set_grads(ours, step), set_grads(ref, step)
        opt.step(), ref_opt.step()
        for q in ref:  # emulate the storage: round the reference's moments to bf16
            st = ref_opt.state[q]
            st["exp_avg"].copy_(st["exp_avg"].bfloat16())
            st["exp_avg_sq"].copy_(st["exp_avg_sq"].bfloat16())
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg"].float(), ref_opt.state[q]["exp_avg"])


def test_close_to_fp32_states_and_half_the_bytes():
    ours, ref = params(), params()
    opt, ref_opt = LowPrecisionAdamW(ours, **HYPER), torch.optim.AdamW(ref, foreach=False, **HYPER)
    init = [p.detach().clone() for p in ref]
    for step in range(50):
        set_grads(ours, step), set_grads(ref, step)
        opt.step(), ref_opt.step()
    for p, q, p0 in zip(ours, ref, init, strict=True):
        # 50 steps of lr 1e-2 move each entry by ~0.3; bf16 moments change that by < 1%.
        assert (p - q).norm() / (q - p0).norm() < 1e-2
    assert state_bytes_per_param(opt) == 4.0 and state_bytes_per_param(ref_opt) == 8.0


def test_master_weights_keep_updates_smaller_than_bf16_spacing():
    """bf16 parameters with an fp32 master copy follow fp32 AdamW; without it, updates below the
    parameters' bf16 spacing are lost."""
    hyper = {**HYPER, "lr": 1e-4, "weight_decay": 0.0}  # updates ~1e-4, far below bf16 spacing of ~1
    with_master, without = params(torch.bfloat16), params(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in with_master]  # the same starting values
    opt_m = LowPrecisionAdamW(with_master, master_weights=True, **hyper)
    opt_n = LowPrecisionAdamW(without, **hyper)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **hyper)
    start = [p.detach().clone() for p in without]
    for step in range(30):
        for ps in (with_master, without, ref):
            set_grads(ps, step)
        opt_m.step(), opt_n.step(), ref_opt.step()
    for p, q, p0 in zip(with_master, ref, start, strict=True):
        master = opt_m.state[p]["master"]
        assert master.dtype == torch.float32
        # The master copy moved as fp32 AdamW's parameters did (bf16 moments: < 2% apart) ...
        assert (master - q.detach()).norm() / (q.detach() - p0.float()).norm() < 2e-2
        assert torch.equal(p, master.bfloat16())  # ... and the parameter is its rounding
    moved = sum(int((p != p0).sum()) for p, p0 in zip(without, start, strict=True))
    assert moved < 0.1 * sum(p.numel() for p in without)  # only entries near zero move at all


@pytest.mark.parametrize("master", [False, True])
def test_state_dict_round_trip_keeps_dtypes_and_continues_exactly(master: bool):
    dtype = torch.bfloat16 if master else torch.float32
    a, b = params(dtype), params(dtype)
    opt_a = LowPrecisionAdamW(a, master_weights=master, **HYPER)
    for step in range(3):
        set_grads(a, step)
        opt_a.step()
    with torch.no_grad():
        for p, q in zip(a, b, strict=True):
            q.copy_(p)
    opt_b = LowPrecisionAdamW(b, master_weights=master, **HYPER)
    opt_b.load_state_dict(opt_a.state_dict())
    for p in b:
        assert opt_b.state[p]["exp_avg"].dtype == torch.bfloat16
        if master:
            assert opt_b.state[p]["master"].dtype == torch.float32
    for step in range(3, 6):
        set_grads(a, step), set_grads(b, step)
        opt_a.step(), opt_b.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


def test_config_selects_it():
    model = torch.nn.Linear(4, 4)
    assert isinstance(build_optimizer(model, OptimizerConfig(state_dtype="bf16"), "cpu"), LowPrecisionAdamW)
    assert type(build_optimizer(model, OptimizerConfig(), "cpu")) is torch.optim.AdamW
