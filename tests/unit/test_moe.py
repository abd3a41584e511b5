"""The MoE block against an independent implementation (Hugging Face Qwen3-MoE), the grouped GEMM
against a loop, and the balance loss / bias update against their definitions."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import PRESETS, ModelArgs
from shardwise.models.moe import (
    CPU_GROUP_ROWS,
    GroupedExperts,
    MoE,
    Router,
    group_alignment,
    grouped_mm,
    pad_groups,
    update_expert_bias,
)
from shardwise.models.transformer import build_model, init_weights
from shardwise.observe.flops import num_params
from tests.helpers import ROOT, require


def tiny(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, n_experts=8, moe_top_k=2,
                moe_hidden_dim=32, n_shared_experts=0, n_dense_layers=0)
    return dataclasses.replace(PRESETS["moe-debug"], **{**base, **kw})


def moe_block(args: ModelArgs, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    m.router.expert_bias.zero_()
    m.tokens_per_expert.zero_()
    return m


def test_matches_huggingface_qwen3_moe_block():
    """Softmax top-k with renormalized weights, SwiGLU experts: output and input gradient equal HF's."""
    require("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    args = tiny()
    ours = moe_block(args)
    ours.balance_loss = False
    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                               num_experts_per_tok=2, norm_topk_prob=True))
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.gate.weight)
        # HF: gate_up_proj (E, 2h, d) applied as x @ W.T; ours: w1/w3 (E, d, h) applied as x @ W.
        hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=2).transpose(1, 2))
        hf.experts.down_proj.copy_(ours.experts.w2.transpose(1, 2))
    x = torch.randn(3, 10, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), hf(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)


def test_router_z_loss_is_the_mean_squared_logsumexp_over_the_steps_tokens():
    """moe_z_coef: ST-MoE's z-loss, coef * mean over every token of the step of logsumexp(logits)^2,
    joins the backward: the router's gradient with it is the one without plus the z-loss's own,
    computed by hand from the gate's logits."""
    x, g = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    grads = []
    for coef in (0.0, 0.1):
        m = moe_block(tiny(moe_balance="none", moe_z_coef=coef))
        m.sequences_per_step = 4  # this micro-batch is half of the step's sequences
        (m(x) * g).sum().backward()
        grads.append(m.router.gate.weight.grad)
    w = moe_block(tiny()).router.gate.weight.detach().requires_grad_()
    z = 0.1 * torch.logsumexp(x.reshape(-1, 64) @ w.T, dim=-1).square().sum() / (4 * 10)
    z.backward()
    # (the difference of two large gradients: fp32's rounding of them, 1e-6 of their size, is the bound)
    torch.testing.assert_close(grads[1] - grads[0], w.grad, rtol=0, atol=1e-6 * grads[0].abs().max())
    assert w.grad.abs().max() > 1e3 * 1e-6 * grads[0].abs().max()  # (a term the comparison can see)


def test_negative_balance_weights_are_refused():
    from shardwise.config.schema import ConfigError
    from shardwise.models import check_args

    with pytest.raises(ConfigError, match=r"model.moe_z_coef=-0.1 must be >= 0"):
        check_args(tiny(moe_z_coef=-0.1))
    with pytest.raises(ConfigError, match=r"model.moe_router_init_std=0.0 must be > 0"):
        check_args(tiny(moe_router_init_std=0.0))
    with pytest.raises(ConfigError, match=r"model.moe_router_lr_scale=0.0 must be > 0"):
        check_args(tiny(moe_router_lr_scale=0.0))
    with pytest.raises(ConfigError, match=r"model.attn_qk_init_std=0.0 must be > 0"):
        check_args(tiny(attn_qk_init_std=0.0))


@pytest.mark.parametrize("std", [0.02, 0.1])
def test_router_weights_start_at_their_own_std(std: float):
    """moe_router_init_std sets the routers' initial weights only (a normal truncated at 3 std has
    0.986 of its std); the experts keep 0.02."""
    model = build_model(tiny(dim=256, moe_router_init_std=std), device="cpu")
    init_weights(model, 0)
    moe = model.layers["0"].feed_forward
    assert moe.router.gate.weight.std().item() == pytest.approx(0.986 * std, rel=0.03)
    assert moe.experts.w1.std().item() == pytest.approx(0.986 * 0.02, rel=0.03)


def test_router_lr_scale_moves_the_routers_by_that_fraction_of_every_update():
    """moe_router_lr_scale: the routers form their own AdamW group whose peak is that fraction of
    optimizer.lr, the schedule scaling it as the others. AdamW's first step is lr * (sign-like ratio
    + decay), so from one start and one gradient the routers move 0.3x as far, all else as far."""
    from shardwise.config.schema import LRSchedulerConfig, OptimizerConfig
    from shardwise.optim.adamw import build_optimizer
    from shardwise.optim.lr import build_lr_scheduler

    moved = {}
    for scale in (1.0, 0.3):
        model = build_model(tiny(moe_router_lr_scale=scale), device="cpu")
        init_weights(model, 0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2, implementation="for-loop"), "cpu",
                              model.args.moe_router_lr_scale)
        sched = build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=4), 10)  # (step 1: 1/4 of each peak)
        model(torch.arange(32).view(2, 16)).float().square().mean().backward()
        opt.step()
        sched.step()
        moved[scale] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        lrs = [g["lr"] for g in opt.param_groups]  # (step 2: 2/4)
        assert lrs == pytest.approx([5e-3, 5e-3] if scale == 1.0 else [5e-3, 5e-3, 1.5e-3])
    router, expert = "layers.0.feed_forward.router.gate.weight", "layers.0.feed_forward.experts.w1"
    torch.testing.assert_close(moved[0.3][router], 0.3 * moved[1.0][router], rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(moved[0.3][expert], moved[1.0][expert], rtol=1e-4, atol=1e-9)
    assert moved[1.0][router].abs().max() > 1e-3  # (the router did move)


def test_attention_qk_init_std_widens_queries_and_keys_only():
    """attn_qk_init_std sets the query and key projections' initial std; in latent attention the
    key rows of wkv_b, its value rows untouched (drawn as before, bit for bit)."""
    from shardwise.models import PRESETS as P

    mla = dataclasses.replace(P["deepseek-debug"], n_layers=2, n_dense_layers=1)
    weights = {}
    for std in (0.02, 0.1):
        model = build_model(dataclasses.replace(mla, attn_qk_init_std=std), device="cpu")
        init_weights(model, 3)
        weights[std] = dict(model.named_parameters())
    a = mla
    for std in (0.02, 0.1):
        kv = weights[std]["layers.1.attention.wkv_b.weight"].detach().view(a.n_heads, -1, a.kv_lora_rank)
        keys, values = kv[:, :a.qk_nope_head_dim], kv[:, a.qk_nope_head_dim:]
        assert keys.std().item() == pytest.approx(0.986 * std, rel=0.05)
        assert values.std().item() == pytest.approx(0.986 * 0.02, rel=0.05)
        queries = weights[std]["layers.1.attention.wq_b.weight"]
        assert queries.std().item() == pytest.approx(0.986 * std, rel=0.05)
    wide, plain = (weights[s]["layers.1.attention.wkv_b.weight"].detach() for s in (0.1, 0.02))
    wide, plain = (t.view(a.n_heads, -1, a.kv_lora_rank) for t in (wide, plain))
    assert torch.equal(wide[:, a.qk_nope_head_dim:], plain[:, a.qk_nope_head_dim:])
    torch.testing.assert_close(wide[:, :a.qk_nope_head_dim], 5 * plain[:, :a.qk_nope_head_dim])
    gqa = build_model(tiny(dim=256, attn_qk_init_std=0.1), device="cpu")
    init_weights(gqa, 0)
    attention = gqa.layers["0"].attention
    for w, std in ((attention.wq, 0.1), (attention.wk, 0.1), (attention.wv, 0.02)):
        assert w.weight.std().item() == pytest.approx(0.986 * std, rel=0.05)


def test_router_scores_are_fp32_under_bf16_autocast():
    """Under autocast the gate's product would run in bf16 and round the logits to 2^-8 of their
    size; the router computes them in fp32 from the same inputs, so the choice does not depend on
    bf16 rounding."""
    router = moe_block(tiny()).router
    x = torch.randn(64, 64)  # (T, dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, ids, scores = router(x)
        bf16 = torch.softmax(router.gate(x).float(), dim=-1)  # what autocast alone computes
    exact = torch.softmax(x @ router.gate.weight.T, dim=-1)
    assert scores.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(scores, exact, rtol=1e-6, atol=1e-7)
    assert (bf16 - exact).abs().max() > 1e-4  # (the bf16 product is measurably not it)
    assert torch.equal(ids, torch.topk(exact, 2, dim=-1).indices)


def test_choice_gap_is_the_margin_each_routing_stage_decided_by():
    """A replayed choice's distance from the router's own: one group, the score difference; with
    DeepSeek-V3's group-limited routing, the group ranks' margin plus the experts' within the group set
    holding the choice -- so a group near-tie swapping far-apart experts is a near-tie (verify's own-
    routing gap would otherwise fail a layout for rounding)."""
    flat = Router(4, 4, 2, "softmax", False, 1.0)
    biased = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    gap = flat.choice_gap(biased, torch.tensor([[0, 1]]), torch.tensor([[0, 2]]))
    assert gap.item() == pytest.approx(0.1)
    grouped = Router(4, 8, 2, "sigmoid", False, 1.0, n_groups=4, topk_groups=2)
    # groups of two: ranks 1.0, 1.0 + 1e-4, 1.0 - 2e-4, 0 -> own groups 1 and 0, experts 0 and 3
    biased = torch.tensor([[0.9, 0.1, 0.5, 0.5001, 0.6, 0.3998, 0.0, 0.0]], dtype=torch.float64)
    own = torch.topk(grouped.group_limited(biased), 2, dim=-1).indices
    assert sorted(own[0].tolist()) == [0, 3]
    swapped = torch.tensor([[4, 3]])  # group 2 in place of group 0: a 2e-4 tie; scores 0.3 apart
    assert (biased.gather(-1, own).sum() - biased.gather(-1, swapped).sum()).item() == pytest.approx(0.3)
    assert grouped.choice_gap(biased, own, swapped).item() == pytest.approx(2e-4)
    second = torch.tensor([[4, 5]])  # group 2 in, and its second expert over expert 3 (0.1003 down)
    assert grouped.choice_gap(biased, own, second).item() == pytest.approx(2e-4 + 0.1003)
    assert grouped.choice_gap(biased, own, own).item() == 0.0
    # a perturbation of 1e-3 flips near-ties; each flipped choice is within a few perturbations of the
    # rule's, however far apart its experts' scores (the other's experts may all sit in one group that
    # the set of the flipped choice did not rank best)
    torch.manual_seed(0)
    scores = torch.rand(20_000, 8, dtype=torch.float64)
    moved = scores + 1e-3 * torch.randn_like(scores)
    before, after = (torch.topk(grouped.group_limited(s), 2, dim=-1).indices for s in (scores, moved))
    flipped = (before.sort(-1).values != after.sort(-1).values).any(-1)
    assert flipped.sum() > 50
    assert grouped.choice_gap(moved, after, before)[flipped].max() < 2e-2
    one_group = Router(4, 8, 2, "sigmoid", False, 1.0, n_groups=4, topk_groups=1)
    assert one_group.choice_gap(biased, torch.tensor([[2, 3]]), torch.tensor([[0, 3]])).item() == float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_a_loop(dtype: torch.dtype):
    counts = torch.tensor([3, 0, 5, 8])  # an expert with no tokens too
    x = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 32, 16, dtype=dtype, requires_grad=True)
    y = grouped_mm(x, w, counts)
    ref = torch.cat([xi @ w[g] for g, xi in enumerate(torch.split(x, counts.tolist()))])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, ref, **tol)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gw, rw, **tol)


def test_padded_groups_hold_each_row_once_and_zeros_elsewhere():
    counts = torch.tensor([3, 0, 5, 70])
    x = torch.arange(78 * 2, dtype=torch.float32).view(78, 2) + 1  # no zero rows of its own
    padded, pcounts, index = pad_groups(x, counts, 64)
    assert pcounts.tolist() == [64, 0, 64, 128]
    assert padded.shape == (256, 2)
    torch.testing.assert_close(padded[index], x)
    # each group's rows lead its padded group, the padding is zero
    starts = [0, 64, 64, 128]
    for g, n in enumerate(counts.tolist()):
        block = padded[starts[g]:starts[g] + int(pcounts[g])]
        torch.testing.assert_close(block[:n], x[sum(counts[:g].tolist()):][:n])
        assert not block[n:].any()


def test_group_alignment_bounds_the_shapes_and_the_padding():
    assert group_alignment(2048, 8) == CPU_GROUP_ROWS  # 256 rows per expert: the floor
    # small groups pad to their mean's power of two, not to 64 (one slot each of 256 experts: none)
    assert [group_alignment(s, 256) for s in (256, 256 * 5, 256 * 40, 256 * 64)] == [1, 4, 32, 64]
    for slots, experts in ((2**16, 8), (2**20, 64), (3 * 2**17, 16)):
        align, mean = group_alignment(slots, experts), slots // experts
        assert align & (align - 1) == 0  # a power of two
        assert mean / 32 < align <= mean / 16  # ~32 group sizes up to 2x the mean; padding ~3%


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_experts_match_unpadded_ones(dtype: torch.dtype):
    """CPU experts pad each group with zero rows (fixed GEMM shapes); outputs and gradients of the
    input and of all three weights are the unpadded products'."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 48).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    counts = torch.tensor([37, 0, 90, 1])
    x = torch.randn(128, 32, dtype=dtype, requires_grad=True)
    y = experts(x, counts)

    def ref_forward(x: torch.Tensor) -> torch.Tensor:
        h = F.silu(grouped_mm(x, experts.w1, counts)) * grouped_mm(x, experts.w3, counts)
        return grouped_mm(h, experts.w2, counts)
    ref = ref_forward(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, ref, **tol)
    g = torch.randn_like(y)
    params = (x, experts.w1, experts.w2, experts.w3)
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g), strict=True):
        torch.testing.assert_close(a, b, **tol)


def _hf_switch_loss(scores: torch.Tensor, ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch/Mixtral's batch balance loss (HF's load_balancing_loss_func) for one sequence."""
    tokens_per_expert = F.one_hot(ids, n_experts).float().mean(0)  # (k, E)
    return (tokens_per_expert * scores.mean(0)).sum() * n_experts


def test_aux_loss_is_the_sequence_balance_loss():
    """coef * E * sum_e f_e P_e per sequence (DeepSeek-V3's normalization: Switch's loss / k),
    averaged over the step's sequences."""
    args = tiny(moe_aux_coef=0.1)
    m = moe_block(args)
    x = torch.randn(2, 12, 64)
    m.sequences_per_step = 2
    _, ids, scores = m.router(x.reshape(-1, 64))
    got = m.aux_loss(ids.view(2, 12, -1), scores.view(2, 12, -1))
    per_seq = [_hf_switch_loss(scores.view(2, 12, -1)[b], ids.view(2, 12, -1)[b], 8) / 2 for b in range(2)]
    torch.testing.assert_close(got, 0.1 * sum(per_seq) / 2)


def test_batch_aux_loss_is_the_switch_loss_over_the_whole_batch():
    """moe_aux_scope=batch: Switch/Mixtral's loss (HF's load_balancing_loss_func) once over every
    token of the batch, / k as the sequence-wise loss; not the mean of the per-sequence losses."""
    m = moe_block(tiny(moe_aux_coef=0.1, moe_aux_scope="batch"))
    x = torch.randn(2, 12, 64)
    x[1] += 3 * torch.randn(64)  # the two sequences route differently
    m.sequences_per_step = 2
    _, ids, scores = m.router(x.reshape(-1, 64))
    got = m.aux_loss(ids.view(2, 12, -1), scores.view(2, 12, -1))
    torch.testing.assert_close(got, 0.1 * _hf_switch_loss(scores, ids, 8) / 2)
    m.aux_scope = "sequence"
    assert not torch.allclose(got, m.aux_loss(ids.view(2, 12, -1), scores.view(2, 12, -1)))


def test_batch_aux_loss_over_micro_batches_is_their_token_weighted_mean():
    """With M forwards per step each is the loss over its own tokens, weighted by its share of the
    step: two micro-batches of one sequence each give the mean of the two one-sequence losses."""
    m = moe_block(tiny(moe_aux_coef=0.1, moe_aux_scope="batch"))
    x = torch.randn(2, 12, 64)
    m.sequences_per_step = 2
    for b in range(2):
        _, ids, scores = m.router(x[b])
        got = m.aux_loss(ids.view(1, 12, -1), scores.view(1, 12, -1))
        torch.testing.assert_close(got, 0.1 * _hf_switch_loss(scores, ids, 8) / 2 / 2)


def test_aux_loss_gradient_joins_the_backward():
    """The loss attached by AuxLossGrad gives the same parameter gradients as adding it explicitly."""
    args = tiny(moe_aux_coef=0.5)
    m = moe_block(args)
    x = torch.randn(2, 12, 64)
    m.sequences_per_step = 2
    m.zero_grad()
    m(x).square().mean().backward()
    attached = m.router.gate.weight.grad.clone()
    m.zero_grad()
    m.balance_loss = False
    y = m(x)
    _, ids, scores = m.router(x.reshape(-1, 64))
    (y.square().mean() + m.aux_loss(ids.view(2, 12, -1), scores.view(2, 12, -1))).backward()
    torch.testing.assert_close(attached, m.router.gate.weight.grad)
    # and the aux term matters: without it the router gradient differs
    m.zero_grad()
    m(x).square().mean().backward()
    assert not torch.allclose(attached, m.router.gate.weight.grad)


def test_balance_loss_does_not_depend_on_the_batch_split():
    """Two sequences at once == each alone, summed: the property that makes it layout-independent."""
    m = moe_block(tiny())
    x = torch.randn(2, 12, 64)
    m.sequences_per_step = 2

    def loss(xs: torch.Tensor) -> torch.Tensor:
        _, ids, scores = m.router(xs.reshape(-1, 64))
        return m.aux_loss(ids.view(xs.shape[0], 12, -1), scores.view(xs.shape[0], 12, -1))
    torch.testing.assert_close(loss(x), loss(x[:1]) + loss(x[1:]))


@pytest.mark.parametrize("balance", ["bias", "bias+aux_loss", "aux_loss"])
def test_bias_update_moves_towards_balance_and_counts_reset(balance: str):
    """The bias (alone or with DeepSeek-V3's sequence-wise loss) moves by the rate towards balance;
    the loss alone leaves it at zero. The loss is on with bias+aux_loss as with aux_loss."""
    args = tiny(moe_balance=balance, moe_bias_rate=0.1, n_layers=1)
    model = build_model(args, device="cpu")
    init_weights(model, 0)
    moe = model.layers["0"].feed_forward
    assert moe.balance_loss == (balance != "bias")
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))  # mean 2
    load = update_expert_bias(model, None)
    assert load.keys() == {0} and load[0].item() == pytest.approx(5.0)  # busiest over mean, by block
    step = [-0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, -0.1] if "bias" in balance else [0.0] * 8
    assert moe.router.expert_bias.tolist() == pytest.approx(step)
    assert moe.tokens_per_expert.sum() == 0


def test_proportional_bias_update_moves_by_each_experts_relative_load_error():
    """moe_bias_update=proportional: each expert's bias moves by the rate times (mean - count) / mean,
    written out by hand; the busiest block's load is reported as with the sign rule."""
    model = build_model(tiny(moe_balance="bias", moe_bias_rate=0.1, moe_bias_update="proportional",
                             n_layers=1), device="cpu")
    init_weights(model, 0)
    moe = model.layers["0"].feed_forward
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 3, 3]))  # mean 2
    assert update_expert_bias(model, None)[0].item() == pytest.approx(5.0)
    # (2 - 10) / 2 = -4, (2 - 0) / 2 = 1, (2 - 3) / 2 = -0.5
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.4, 0.1, 0.1, 0.1, 0.1, 0.1, -0.05, -0.05])
    moe.tokens_per_expert.fill_(5.0)  # balanced: no move
    update_expert_bias(model, None)
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.4, 0.1, 0.1, 0.1, 0.1, 0.1, -0.05, -0.05])


def test_bias_and_aux_loss_together_route_by_the_bias_and_add_the_loss():
    """bias+aux_loss: the experts are chosen on score + bias as with bias alone, and the router's
    gradient is the language loss's plus the sequence-wise loss's, as with aux_loss alone."""
    x = torch.randn(2, 12, 64)
    grads, outs = {}, {}
    for balance in ("bias", "bias+aux_loss"):
        m = moe_block(tiny(moe_balance=balance, moe_aux_coef=0.5))
        m.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
        m.sequences_per_step = 2
        outs[balance] = m(x)
        aux = 0.0
        if balance == "bias+aux_loss":  # the loss, added by hand on the module's own routing
            _, ids, scores = m.router(x.reshape(-1, 64))
            aux = m.aux_loss(ids.view(2, 12, -1), scores.view(2, 12, -1))
        (outs[balance].square().mean() + (aux if balance == "bias" else 0.0)).backward()
        grads[balance] = m.router.gate.weight.grad.clone()
        if balance == "bias+aux_loss":
            m.zero_grad()
            m.balance_loss = False
            (m(x).square().mean() + aux).backward()
            torch.testing.assert_close(grads[balance], m.router.gate.weight.grad)
    torch.testing.assert_close(outs["bias"], outs["bias+aux_loss"])  # same routing, same output
    assert not torch.allclose(grads["bias"], grads["bias+aux_loss"])  # the loss's gradient is there


def test_counts_only_training_forwards():
    model = build_model(tiny(n_layers=1), device="cpu")
    init_weights(model, 0)
    moe = model.layers["0"].feed_forward
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 8)))
    assert moe.tokens_per_expert.sum() == 0  # evaluation does not count
    model(torch.randint(0, 128, (2, 8)))
    assert moe.tokens_per_expert.sum() == 2 * 8 * 2  # every token, top-2


@pytest.mark.parametrize("mode,compiled", [("full", False), ("selective", False), ("full", True)])
def test_a_checkpointed_block_counts_its_tokens_once(mode: str, compiled: bool):
    """Activation checkpointing runs a block's forward again inside backward: the routed tokens are
    counted in the forward only (count_routed, an opaque op, so a compiled block keeps one graph)."""
    from shardwise.config.schema import ActivationCheckpointConfig
    from shardwise.parallel.ac import apply_ac
    from shardwise.parallel.compile import apply_compile

    torch._dynamo.reset()
    model = build_model(tiny(n_layers=1), device="cpu")
    init_weights(model, 0)
    apply_ac(model, ActivationCheckpointConfig(mode=mode))
    apply_compile(model, compiled)
    moe = model.layers["0"].feed_forward
    model(torch.randint(0, 128, (2, 8))).float().sum().backward()
    assert moe.tokens_per_expert.sum() == 2 * 8 * 2  # every token once, top-2


@pytest.mark.parametrize("precision", ["bf16", "autocast"])
def test_an_moe_block_compiles_to_one_graph_on_the_gpu_path(monkeypatch: pytest.MonkeyPatch, precision: str):
    """Without the CPU's group padding (whose host sync is CPU-only), an MoE block traces to one
    graph: nothing in routing, counting or the grouped GEMMs sends the compiled block back to the
    host (the token count's autograd check once broke it into four graphs). bf16: FSDP's bf16
    parameters; autocast: fp32 parameters and residual stream under bf16 autocast (a one-rank run
    without FSDP), where the experts cast tokens and weights by hand."""
    from shardwise.models import moe

    monkeypatch.setattr(moe, "pads_groups", lambda x: False)
    args = dataclasses.replace(tiny(n_layers=1), moe_balance="bias", moe_aux_coef=0.0)
    model = build_model(args, device="cpu")
    init_weights(model, 0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = model.to(dtype)
    x = torch.randn(2, 16, args.dim, dtype=dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        explained = torch._dynamo.explain(model.layers["0"])(x, model.rope.float(), None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_presets_count_parameters():
    """Qwen3-30B-A3B's published sizes: 30.5B parameters, 3.3B active."""
    args = PRESETS["qwen3-30b-a3b"]
    assert sum(p.numel() for p in build_model(args).parameters()) == num_params(args)
    assert num_params(args) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert num_params(args, active=True) / 1e9 == pytest.approx(3.35, abs=0.05)
    moe = PRESETS["moe-debug"]
    assert sum(p.numel() for p in build_model(moe).parameters()) == num_params(moe)


# bf16 products with a new row count at every call, as the experts make them; prints the growth of
# the resident set in MiB. argv: the cache cap to set first ("none": the library defaults), rounds.
_ROW_COUNTS = """
import os, random, sys
from shardwise.runtime.machine import bound_matmul_caches, keep_freed_cpu_memory
if sys.argv[1] != "none":
    assert bound_matmul_caches(int(sys.argv[1]))
import torch
keep_freed_cpu_memory()
torch.set_num_threads(1)
x, w = torch.randn(2048, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
out = torch.empty(2048, 256, dtype=torch.bfloat16)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
random.seed(0)
torch.mm(x[:7], w, out=out[:7])
start = rss()
for _ in range(int(sys.argv[2])):
    cuts = sorted(random.sample(range(1, 2048), 7))
    for a, b in zip([0, *cuts], [*cuts, 2048]):
        torch.mm(x[a:b], w, out=out[a:b])
print(rss() - start)
"""


def _row_count_growth(cap: str, rounds: int = 300) -> float:
    from shardwise.runtime.machine import MATMUL_CACHE_ENV

    env = {k: v for k, v in os.environ.items() if k not in MATMUL_CACHE_ENV}
    proc = subprocess.run([sys.executable, "-c", _ROW_COUNTS, cap, str(rounds)], capture_output=True,
                          text=True, env=env, check=True)
    return float(proc.stdout.split()[-1])


def test_capped_matmul_caches_stop_the_row_count_growth():
    """In bf16 each new row count adds an entry to oneDNN's and ideep's shape-keyed caches (1024
    each): these 300 rounds of 8 grew 468 MiB with the defaults and 70 MiB capped at 64 on an
    AVX512-BF16 CPU. A CPU without native bf16 emulates the products outside those caches (on an
    AVX2 CPU 40 rounds grew 1 MiB, capped or not, and 600 rounds take two minutes): a short probe
    finds out which kind this is. Where the caches fill, the caps must cut the growth to 0.4x or
    100 MiB; where they do not, the capped run must not grow either (the caps cost nothing there)."""
    free_probe, capped_probe = _row_count_growth("none", rounds=40), _row_count_growth("64", rounds=40)
    if free_probe < 8.0:
        assert capped_probe < 8.0, (free_probe, capped_probe)
        return
    free, capped = _row_count_growth("none"), _row_count_growth("64")
    assert capped <= max(0.4 * free, 100.0), (free, capped)


def test_matmul_cache_caps_leave_a_users_setting(monkeypatch: pytest.MonkeyPatch):
    from shardwise.runtime.machine import MATMUL_CACHE_ENV, bound_matmul_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "2048")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert not bound_matmul_caches(64)
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    monkeypatch.delenv("LRU_CACHE_CAPACITY")
    assert bound_matmul_caches(32)
    assert all(os.environ[name] == "32" for name in MATMUL_CACHE_ENV)


def test_balance_settings_are_training_choices_not_another_function():
    """An HF MoE model imported, or a checkpoint resumed, with another z-loss weight or balance-loss
    scope computes the same function: neither is refused as a different model (the z-loss was)."""
    from shardwise.checkpoint.manifest import TRAINING_ONLY_FIELDS
    from shardwise.models.hf_config import check_hf_config, hf_config

    args = dataclasses.replace(PRESETS["moe-debug"], n_shared_experts=0, qk_norm=True)
    trained = dataclasses.replace(args, moe_z_coef=1e-3, moe_aux_scope="batch")
    check_hf_config(hf_config(args, "fp32"), trained)
    assert {"moe_z_coef", "moe_aux_scope"} <= set(TRAINING_ONLY_FIELDS)


@pytest.mark.parametrize("micro_batch,said", [(0, False), (4, True)])
def test_batch_scope_under_micro_batches_is_said(micro_batch: int, said: bool, capsys: pytest.CaptureFixture):
    """moe_aux_scope=batch is over the whole batch with one forward per rank; under accumulation it is
    over each micro-batch, which a notice says (and only then)."""
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.run import resolve_run

    cfg = load_config(str(ROOT / "configs" / "moe-debug.toml"), [
        "--run.device=cpu", "--model.moe_aux_scope=batch", f"--training.micro_batch={micro_batch}"])
    run = resolve_run(cfg, 1)
    assert run.micro_batches == (2 if said else 1)
    out = capsys.readouterr()
    assert ("notice: model.moe_aux_scope=batch with 2 micro-batches per rank" in out.out + out.err) == said


def test_router_inputs_splits_the_residual_into_its_parts_and_finds_a_planted_shared_vector():
    """bench/router_inputs.py: the parts (embedding, attention and feed-forward outputs) make up the
    residual read at the last MoE block's feed-forward input, their projections its token mean; a
    constant vector planted in block 0's attention output shows as a part whose projection is its
    whole size and makes every later router input nearly one direction."""
    spec = importlib.util.spec_from_file_location("router_inputs", ROOT / "bench" / "router_inputs.py")
    router_inputs = importlib.util.module_from_spec(spec)  # (by path: bench/ stays off sys.path)
    spec.loader.exec_module(router_inputs)

    model = build_model(tiny(n_layers=3, n_dense_layers=1), device="cpu")
    init_weights(model, 0)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))  # (B, S)
    plain = router_inputs.router_inputs(model, tokens)
    assert [n for n, _, _ in plain["parts"]] == ["embedding", "attention 0", "feed-forward 0", "attention 1",
                                                  "feed-forward 1", "attention 2"]
    assert plain["unexplained"] < 1e-5 * plain["residual"]  # (one feed-forward left out: 4.6e-4)
    assert sum(p for _, p, _ in plain["parts"]) == pytest.approx(plain["residual"], rel=1e-4)
    assert list(plain["alike"]) == [1, 2] and max(plain["alike"].values()) < 0.5

    shared = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 100  # (dim,)
    hook = model.layers["0"].attention.register_forward_hook(lambda _m, _a, out: out + shared)
    planted = router_inputs.router_inputs(model, tokens)
    hook.remove()
    _, projection, size = planted["parts"][1]
    assert projection > 0.99 * size
    assert min(planted["alike"].values()) > 0.95
