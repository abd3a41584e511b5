"""LoRA (shardwise/models/lora.py) in one process: step 0 is the base model, only the adapters train
and hold optimizer state, the adapted forward equals PEFT's on transformers' Llama with the same
weights, and folding the adapters in (what an export writes) computes what the adapters do."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.config.lora import LoRAConfig
from shardwise.config.schema import ConfigError, OptimizerConfig
from shardwise.models.hf_config import rope_rows, to_rotate_half
from shardwise.models.lora import (
    LoRALinear,
    apply_lora,
    check_targets,
    flops_change_per_token,
    fold_lora,
    merged,
)
from shardwise.models.transformer import build_model, init_weights
from shardwise.observe.flops import matmul_params
from shardwise.optim.adamw import build_optimizer
from tests.helpers import TINY_MODEL, require

LORA = LoRAConfig(rank=4, alpha=8.0)


def _model(lora: LoRAConfig | None, seed: int = 3, args=TINY_MODEL):  # noqa: ANN001, ANN202
    model = build_model(args)
    if lora is not None:
        apply_lora(model, lora)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def _nonzero_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """B drawn too (it starts at zero), so the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.05)


def test_step_zero_is_the_base_model_and_only_the_adapters_train():
    base, lora = _model(None), _model(LORA)
    names = {n for n, p in lora.named_parameters() if p.requires_grad}
    adapted = [n for n, m in lora.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 7 * TINY_MODEL.n_layers  # wq wk wv wo w1 w2 w3 of each block, not the head
    assert names == {f"{n}.{p}" for n in adapted for p in ("lora_a", "lora_b")}
    # the base weights are drawn by name as without LoRA; B = 0: the same logits, bit for bit
    for n, p in base.named_parameters():
        assert torch.equal(p, lora.get_parameter(n)), n
    a = lora.get_parameter("layers.0.attention.wq.lora_a")
    assert a.abs().max() <= TINY_MODEL.dim ** -0.5 and a.std() > 0.3 * TINY_MODEL.dim ** -0.5
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 16))
    assert torch.equal(base(tokens), lora(tokens))
    # three steps: the base stays, every adapter moves; AdamW holds the adapters' moments only
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    opt = build_optimizer(lora, OptimizerConfig(lr=1e-2), "cpu")
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(lora(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(frozen[n], p) for n, p in lora.named_parameters() if n in frozen)
    assert all(lora.get_parameter(n).grad is None for n in frozen)
    assert all(lora.get_parameter(f"{n}.lora_b").abs().sum() > 0 for n in adapted)
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    adapter_elems = sum(lora.get_parameter(n).numel() for n in names)
    assert held == 2 * 4 * adapter_elems  # exp_avg and exp_avg_sq in fp32, of the adapters alone


def test_the_adapted_forward_equals_peft_on_transformers_llama():
    """The independent reference: PEFT's LoRA on transformers' LlamaForCausalLM, given our base
    weights (through the HF mapping the exporter uses) and our adapters, computes our logits."""
    transformers, peft = require("transformers"), require("peft")
    from shardwise.checkpoint.hf import to_hf_state

    args = dataclasses.replace(TINY_MODEL, rope_theta=10000.0)
    ours = _model(LORA, args=args)
    _nonzero_adapters(ours)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}, attention_bias=False,
        mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    state = {n: p.detach() for n, p in ours.named_parameters()}
    hf.load_state_dict(to_hf_state(state, args), strict=False)
    hf_names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w1": "mlp.gate_proj", "w2": "mlp.down_proj", "w3": "mlp.up_proj"}
    targets = sorted({v.split(".")[1] for v in hf_names.values()})
    model = peft.get_peft_model(hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                                    target_modules=targets))
    with torch.no_grad():
        for name, m in ours.named_modules():
            if isinstance(m, LoRALinear):
                block, leaf = name.split(".")[1], name.rpartition(".")[2]
                theirs = model.get_submodule(f"base_model.model.model.layers.{block}.{hf_names[leaf]}")
                theirs.lora_A["default"].weight.copy_(m.lora_a)
                # B's rows are the output rows: q/k's are permuted as their weights are
                b = rope_rows(f"{name}.weight", m.lora_b, args, to_rotate_half)
                theirs.lora_B["default"].weight.copy_(b)
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        want = model.eval()(tokens).logits
        got = ours.eval()(tokens)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert (got - ours_without_adapters(args)(tokens)).abs().max() > 1e-3  # (the adapters do matter)


def ours_without_adapters(args):  # noqa: ANN001, ANN201
    return _model(None, args=args).eval()


def test_folding_the_adapters_in_computes_what_they_do():
    lora = _model(LORA)
    _nonzero_adapters(lora)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 16))
    with torch.no_grad():
        want = lora(tokens)
        state = {n: p.detach().clone() for n, p in lora.named_parameters()}
        fold_lora(lora)
        got = lora(tokens)
    assert not any(isinstance(m, LoRALinear) for m in lora.modules())
    assert {n for n, _ in lora.named_parameters()} == {n for n in state if not n.endswith(("_a", "_b"))}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    get = merged(state.__getitem__, set(state), LORA.rank, LORA.alpha)  # what the exporter reads
    for n, p in lora.named_parameters():
        torch.testing.assert_close(get(n), p, atol=1e-6, rtol=1e-6)
    w, a, b = (state[f"layers.1.feed_forward.w2.{k}"] for k in ("weight", "lora_a", "lora_b"))
    torch.testing.assert_close(get("layers.1.feed_forward.w2.weight"), w + LORA.alpha / LORA.rank * b @ a)


def test_a_target_that_names_no_linear_is_refused_and_one_an_moe_model_lacks_is_said():
    with pytest.raises(ConfigError, match="lora.targets: 'q_proj' names no linear of this model; its "
                                          "linears are w1, w2, w3, wk, wo, wq, wv \\(or all-linear\\)"):
        check_targets(TINY_MODEL, LoRAConfig(rank=4, targets="wq,q_proj"))
    assert check_targets(TINY_MODEL, LORA) == ""
    with pytest.raises(ConfigError, match=r"the output head \('output'\) takes no adapter yet"):
        check_targets(TINY_MODEL, LoRAConfig(rank=4, targets="wq,output"))
    moe = dataclasses.replace(TINY_MODEL, n_experts=4, moe_top_k=2)  # routed experts only: no w1-w3 linears
    assert check_targets(moe, LoRAConfig(rank=4)) == ("lora: the routed experts stay frozen (they take no "
                                                      "adapter yet): adapting wk, wo, wq, wv")
    said = check_targets(moe, LoRAConfig(rank=4, targets="wq,wk,wv,wo,w1,w2,w3"))
    assert said == ("lora: the routed experts stay frozen (they take no adapter yet); this model has no w1, "
                    "w2, w3 linear: adapting wq, wk, wv, wo")
    model = build_model(moe)
    assert len(apply_lora(model, LoRAConfig(rank=4))) == 4 * moe.n_layers
    with pytest.raises(ConfigError, match="none of w1,w2 is a linear of this model"):
        check_targets(moe, LoRAConfig(rank=4, targets="w1,w2"))


def test_lora_step_flops_drop_the_frozen_weight_gradients_and_add_the_adapters():
    model = build_model(TINY_MODEL)
    apply_lora(model, LoRAConfig(rank=4, targets="wq,w2"))
    a = TINY_MODEL
    adapters = a.n_layers * 4 * ((a.dim + a.n_heads * a.head_dim) + (a.ffn_hidden_dim + a.dim))
    assert flops_change_per_token(model, matmul_params(a)) == 6 * adapters - 2 * matmul_params(a)
    assert flops_change_per_token(build_model(a), matmul_params(a)) == 0.0


def test_under_tensor_parallel_the_adapters_split_with_their_weight():
    """tp=2 x dp_shard=2 built as the trainer builds it (on torch's fake process group): a
    column-parallel linear's B is split by rows like its weight and A is whole; a row-parallel one's A
    is split by columns like its weight and B is whole; FSDP then shards each over dp_shard; only the
    adapters train (the norms torch's SequenceParallel re-creates are frozen again)."""
    from torch.distributed.tensor import Replicate, Shard

    from shardwise.plan.states import build_rank, fake_world
    from shardwise.resolve.checks import load_config
    from tests.helpers import ROOT, planned

    cfg = load_config(ROOT / "configs" / "debug.toml", ["--parallel.tp=2", "--parallel.dp_shard=2",
                                                        "--lora.rank=4"])
    with fake_world(4, 0):
        model, _ = build_rank(planned(cfg, 4), every_block=True)
        tp = [d.placements[-1] for d in (model.get_parameter(f"layers.0.{n}") for n in (
            "attention.wq.weight", "attention.wq.lora_a", "attention.wq.lora_b",
            "attention.wo.weight", "attention.wo.lora_a", "attention.wo.lora_b"))]
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        wq_b = model.get_parameter("layers.0.attention.wq.lora_b")
        mesh_dims = wq_b.device_mesh.mesh_dim_names
    assert tp == [Shard(0), Replicate(), Shard(0), Shard(1), Shard(1), Replicate()]
    assert mesh_dims == ("dp_shard", "tp") and wq_b.placements[0].dim == 0  # FSDP's shard of the tp shard
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
