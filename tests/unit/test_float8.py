"""Float8 training (torchao, per-tensor current scaling; emulated GEMMs on CPU): which linears are
converted, numerics against the high-precision model, and 16-byte aligned precomputed scales."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardwise.config.schema import Float8Config
from shardwise.models import PRESETS
from shardwise.models.transformer import build_model, init_weights
from shardwise.parallel.float8 import (
    apply_float8,
    float8_groups,
    float8_weights,
    gathers_float8,
    is_float8,
    precompute_scales,
)
from tests.helpers import ROOT

ARGS = dataclasses.replace(PRESETS["debug"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                           vocab_size=512, max_seq_len=128)
CFG = Float8Config(enabled=True, min_dim=16)
TOKENS = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(0))


def converted(args=ARGS, cfg: Float8Config = CFG, tp: int = 1) -> torch.nn.Module:  # noqa: ANN001
    m = build_model(args, device="cpu")
    init_weights(m, 0)
    apply_float8(m, cfg, tp, "cpu")
    return m


def test_groups_whole_and_filtered():
    m = converted()
    f8 = sorted(n for n, mod in m.named_modules() if is_float8(mod))
    assert len(f8) == 7 * ARGS.n_layers  # wq wk wv wo w1 w2 w3 per block
    assert not is_float8(m.output)  # the head stays in high precision
    # Under tp=2 the MLP's local width 176/2 = 88 is not a multiple of 16: it stays whole in bf16.
    plain = build_model(ARGS, device="meta")
    assert float8_groups(plain, CFG, tp=2) == ["layers.0.attention", "layers.1.attention"]
    assert float8_groups(plain, Float8Config(enabled=True, min_dim=128), tp=1) == []
    moe = build_model(dataclasses.replace(PRESETS["moe-debug"], dim=64, n_heads=4, n_kv_heads=2,
                                          moe_hidden_dim=32, n_experts=4), device="meta")
    groups = float8_groups(moe, Float8Config(enabled=True, min_dim=32), tp=1)
    assert "layers.1.feed_forward.shared_expert" in groups and "layers.1.feed_forward" not in groups


def test_disabled_converts_nothing():
    m = converted(cfg=Float8Config(enabled=False))
    assert not any(is_float8(mod) for mod in m.modules())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_high_precision_forward_and_backward(dtype: torch.dtype, recipe: str):
    """float8 (3 mantissa bits for E4M3) loses precision in every GEMM: the loss and gradients are
    near the high-precision ones, and measurably not equal to them (the casts really happen)."""
    ref = build_model(ARGS, device="cpu")
    init_weights(ref, 0)
    f8 = converted(cfg=dataclasses.replace(CFG, recipe=recipe))
    losses, grads = [], []
    for m in (ref, f8):
        m.to(dtype)
        logits = m(TOKENS).flatten(0, 1).float()
        loss = torch.nn.functional.cross_entropy(logits, TOKENS.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    assert abs(losses[1] - losses[0]) / losses[0] < 2e-3
    for name, g in grads[0].items():
        err = ((grads[1][name] - g).norm() / g.norm()).item()
        assert err < 0.15, name
        if ".wq." in name or ".w1." in name:
            assert err > 1e-3, name  # float8 rounding is visible


def test_rowwise_scales_each_row():
    """float8.recipe=rowwise converts to torchao's rowwise linears, which give each row its own
    scale: with weight rows 2^-18 apart in magnitude, the small rows' outputs keep E4M3's relative
    precision, where one tensor-wide scale pushes them into its subnormals."""
    from shardwise.parallel.float8 import tensorwise

    torch.manual_seed(0)
    x = torch.randn(128, ARGS.dim)
    errs = {}
    for recipe in ("tensorwise", "rowwise"):
        m = converted(cfg=dataclasses.replace(CFG, recipe=recipe))
        lin = m.layers["0"].attention.wq
        assert is_float8(lin) and tensorwise(lin) == (recipe == "tensorwise")
        with torch.no_grad():
            lin.weight[16:] *= 2.0**-18
            want = x @ lin.weight.t()
        out = lin(x)
        errs[recipe] = ((out[:, 16:] - want[:, 16:]).norm() / want[:, 16:].norm()).item()
    assert errs["rowwise"] < 0.1 < errs["tensorwise"], errs


def test_precomputed_scales_are_16_byte_aligned(one_rank_group: None):
    m = build_model(ARGS, device="meta")
    cfg = Float8Config(enabled=True, min_dim=16, fsdp_all_gather=True)
    apply_float8(m, cfg, 1, "cpu")
    mesh = init_device_mesh("cpu", (1,))
    for block in m.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    m.to_empty(device="cpu")
    init_weights(m, 0)
    assert gathers_float8(m, cfg)
    weights = float8_weights(m)
    assert len(weights) == 7 * ARGS.n_layers
    # torchao alone leaves the scales as views at 4-byte steps into one tensor: most misaligned.
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(m)
    raw = [w._local_tensor._precomputed_scale.data_ptr() % 16 for w in weights]
    assert any(raw)
    precompute_scales(m)
    scales = [w._local_tensor._precomputed_scale for w in weights]
    assert all(s.data_ptr() % 16 == 0 for s in scales)
    # Each scale is fp8_max / amax of its (whole) weight.
    for w, s in zip(weights, scales, strict=True):
        amax = w.full_tensor().abs().max().double()
        assert s.item() == pytest.approx((torch.finfo(torch.float8_e4m3fn).max / amax).item(), rel=1e-6)
    loss = m(TOKENS).float().logsumexp(-1).mean()  # the forward runs on the precomputed scales
    loss.backward()
    assert torch.isfinite(loss)


def test_the_log_says_what_float8_converts_and_converting_nothing_is_an_error(capsys, tmp_path):
    from shardwise.config.schema import ConfigError
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.preflight import preflight
    from shardwise.resolve.run import resolve_run

    def check_layout(cfg, world: int) -> None:  # noqa: ANN001 - the trainer's checks, no process group
        preflight(resolve_run(cfg, world))

    cfg = load_config(ROOT / "configs" / "moe-debug.toml",
                      ["--float8.enabled=true", f"--run.dir={tmp_path}", "--compile.enabled=false"])
    check_layout(cfg, 1)
    line = capsys.readouterr().out.strip()
    assert line.startswith("notice: float8: 42 linears in 12 groups run in float8, tensorwise scaling "
                           "(layers.<i>.attention x6")
    assert "layers.<i>.feed_forward.router x5: the MoE router" in line
    assert "output x1: the output head" in line
    tiny = ["--float8.enabled=true", f"--run.dir={tmp_path}", "--model.dim=64", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--model.multiple_of=16", "--model.n_layers=2"]
    check_layout(load_config(ROOT / "configs" / "debug.toml", tiny), 1)
    assert "layers.<i>.attention x2: wk has 32 output features" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"float8.enabled=true converts no linear \(layers.0.attention: wk "
                                          r"has 32 output features.*min_dim=256\)"):
        check_layout(load_config(ROOT / "configs" / "debug.toml", [*tiny, "--float8.min_dim=256"]), 1)


def test_tp_rounding_leaves_float8_layers_to_their_own_rounding():
    """debug.tp_rounding splits the plain linears TP splits (here the head, the rest are float8),
    never a float8 layer, whose forward is torchao's (a subclass of nn.Linear)."""
    from shardwise.parallel.tensor import emulate_tp_rounding

    m = converted()
    with torch.no_grad():
        whole = m(TOKENS)  # (B, S, vocab)
        emulate_tp_rounding(m, 2)
        split = m(TOKENS)
    assert "forward" in vars(m.output)
    f8 = [mod for mod in m.modules() if is_float8(mod)]
    assert f8 and not any("forward" in vars(mod) for mod in f8)
    torch.testing.assert_close(split, whole)  # (the head's slices, in order: the same math)
