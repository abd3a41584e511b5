"""The model against references: RoPE and its Llama-3.1 scaling from their definitions, attention
masking, and the whole forward against Hugging Face's independent LlamaForCausalLM."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import PRESETS, ModelArgs
from shardwise.models.transformer import (
    Transformer,
    apply_rope,
    build_model,
    document_mask,
    init_weights,
    rope_table,
)
from shardwise.observe.flops import num_params
from tests.helpers import TINY_MODEL, require


def tiny_model(args: ModelArgs = TINY_MODEL, seed: int = 0) -> Transformer:
    model = build_model(args)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def test_rope_matches_rotation_of_each_channel_pair():
    args = dataclasses.replace(TINY_MODEL, rope_theta=10000.0)
    d = args.head_dim
    x = torch.randn(2, 5, 3, d, dtype=torch.float64).float()
    out = apply_rope(x, rope_table(args)[:5])
    for pos in range(5):
        for i in range(d // 2):
            theta = pos * 10000.0 ** (-2 * i / d)
            a, b = x[:, pos, :, 2 * i], x[:, pos, :, 2 * i + 1]
            torch.testing.assert_close(out[:, pos, :, 2 * i], a * math.cos(theta) - b * math.sin(theta),
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[:, pos, :, 2 * i + 1], a * math.sin(theta) + b * math.cos(theta),
                                       atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    freqs = rope_table(TINY_MODEL)
    q, k = torch.randn(1, 1, 1, TINY_MODEL.head_dim), torch.randn(1, 1, 1, TINY_MODEL.head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        return (apply_rope(q, freqs[m:m + 1]) * apply_rope(k, freqs[n:n + 1])).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(score(7, 7), score(0, 0), atol=1e-5, rtol=1e-5)


def test_llama31_rope_scaling_matches_published_rule():
    args = dataclasses.replace(PRESETS["8b"], max_seq_len=4)
    cos, sin = rope_table(args)[1].unbind(-1)
    got = torch.atan2(sin, cos)  # position 1: the angle is the frequency itself
    d = args.head_dim
    for i, f in enumerate(1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)):
        f = float(f)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want = f
        elif wavelen > 8192 / 1.0:
            want = f / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f
        assert abs(float(got[i]) - want) <= 1e-6 * max(want, 1e-3), (i, float(got[i]), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [False, True])
def test_compiled_rope_matches_eager(dtype, positions):
    """The compiled rotation (real arithmetic, fused by inductor) against the eager one (a complex
    multiply), forward and input gradient, for the shared table and per-sequence positions."""
    torch._dynamo.reset()
    table = rope_table(TINY_MODEL)
    rope = table[torch.randint(0, TINY_MODEL.max_seq_len, (2, 7))] if positions else table[:7]
    x = torch.randn(2, 7, 3, TINY_MODEL.head_dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 7, 3, TINY_MODEL.head_dim, dtype=dtype)
    outs = []
    for fn in (apply_rope, torch.compile(apply_rope, fullgraph=True)):
        out = fn(x, rope)
        (g,) = torch.autograd.grad(out, x, grad)
        outs.append((out, g))
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for eager, compiled in zip(*outs, strict=True):
        assert eager.dtype == compiled.dtype == dtype
        torch.testing.assert_close(compiled, eager, **tol)
    # ... and bf16 rounds the same fp32 products: at most one bf16 step apart
    if dtype == torch.bfloat16:
        assert ((outs[0][0].float() - outs[1][0].float()).abs() <= outs[0][0].float().abs() * 2**-7).all()


def test_attention_is_causal():
    model = tiny_model()
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY_MODEL.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


TINY_MLA = dataclasses.replace(TINY_MODEL, n_kv_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=8, v_head_dim=12)


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_document_mask_isolates_documents(latent: bool):
    args = TINY_MLA if latent else TINY_MODEL
    model = tiny_model(args)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10])
    changed = tokens.clone()
    changed[:, :6] = (changed[:, :6] + 5) % args.vocab_size  # rewrite the first document only
    a, b = model(tokens, docs), model(changed, docs)
    torch.testing.assert_close(a[:, 6:], b[:, 6:])  # the second document cannot see the first
    # ...and without the mask it would have: the test can fail.
    assert not torch.allclose(model(tokens)[:, 6:], model(changed)[:, 6:])
    mask = document_mask(docs)[0, 0]
    assert mask[7, 6] and not mask[7, 5] and not mask[6, 7]


def _doc_ids(b: int, s: int, lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row]
    assert all(len(r) == s for r in rows) and len(rows) == b
    return torch.stack(rows)


@pytest.mark.parametrize("layout", ["one", "two", "many", "mixed"])
@pytest.mark.parametrize("kv_heads,v_dim", [(4, 16), (2, 16), (4, 24)])
def test_attention_by_document_equals_the_dense_mask(layout, kv_heads, v_dim):
    """Document-masked attention from run lengths equals SDPA under the dense (B, 1, S, S) mask,
    forward and every input's gradient (fp32, 1e-5), for one, two and many documents per window,
    grouped-query heads and a value width unlike the key's (latent attention)."""
    from shardwise.models.layers import AttentionCore, DocumentSpans

    s = 64
    lengths = {"one": [[64], [64]], "two": [[20, 44], [63, 1]],
               "many": [[1, 2, 3, 5, 8, 13, 32], [4] * 16],
               "mixed": [[64], [10, 10, 10, 34]]}[layout]
    docs = _doc_ids(2, s, lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, s, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, s, v_dim, generator=gen, requires_grad=True)
    weight = torch.randn(2, 4, s, v_dim, generator=gen)
    spans = DocumentSpans.of(docs)
    assert sum(spans.lengths) == 2 * s and len(spans.lengths) == sum(len(r) for r in lengths)
    core = AttentionCore(scale=0.3)
    out = core(q, k, v, spans)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs),
                                                           enable_gqa=kv_heads != 4, scale=0.3)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    if layout != "one":  # the documents matter: plain causal attention differs
        causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=kv_heads != 4, scale=0.3)
        assert not torch.allclose(out, causal, atol=1e-3)


def test_document_masked_model_equals_the_dense_mask_model(monkeypatch: pytest.MonkeyPatch):
    """The whole model with document spans equals it with the dense mask handed to SDPA (logits and
    parameter gradients), on a dense and a latent-attention (MLA) preset; the dense side is checked
    to have run in every layer, and to differ from plain causal attention (the documents matter)."""
    from shardwise.models import layers

    for args in (TINY_MODEL, TINY_MLA):
        model = tiny_model(args)
        tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        docs = _doc_ids(2, 32, [[5, 27], [8, 8, 8, 8]])
        out = model(tokens, docs)
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
        dense, calls = document_mask(docs), []

        def dense_attention(q, k, v, spans, scale=None, dense=dense, calls=calls):  # noqa: ANN001, ANN202
            calls.append(q.shape)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, enable_gqa=q.shape[1] != k.shape[1], scale=scale)

        with monkeypatch.context() as m:
            m.setattr(layers, "attention_by_document", dense_attention)
            ref = model(tokens, docs)
            assert len(calls) == args.n_layers, (len(calls), args.n_layers)
            ref_grads = torch.autograd.grad(ref.square().mean(), list(model.parameters()))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, model(tokens), atol=1e-3)  # causal alone is not what ran


def test_gqa_equals_repeated_kv_heads():
    """A GQA model equals the MHA model whose K/V projections repeat each KV head."""
    gqa = tiny_model()
    mha = tiny_model(dataclasses.replace(TINY_MODEL, n_kv_heads=TINY_MODEL.n_heads))
    sd = gqa.state_dict()
    rep = TINY_MODEL.n_heads // TINY_MODEL.n_kv_heads
    for name in list(sd):
        if name.endswith(("wk.weight", "wv.weight")):
            w = sd[name].view(TINY_MODEL.n_kv_heads, TINY_MODEL.head_dim, -1)  # (Hkv, D, dim)
            sd[name] = w.repeat_interleave(rep, 0).flatten(0, 1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens), atol=1e-5, rtol=1e-5)


def _hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved RoPE layout -> HF's rotate-half layout for a q/k projection."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


@pytest.mark.parametrize("tie,scaling", [(False, 1.0), (True, 8.0)])
def test_forward_matches_huggingface_llama(tie: bool, scaling: float):
    transformers = require("transformers")
    args = dataclasses.replace(TINY_MODEL, tie_embeddings=tie, rope_scaling_factor=scaling,
                               rope_original_max_seq_len=16, rope_theta=10000.0)
    ours = tiny_model(args, seed=3)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if scaling != 1.0:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": scaling,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=tie, rope_parameters=rope,
        attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {"model.embed_tokens.weight": ours.tok_embeddings.weight, "model.norm.weight": ours.norm.weight}
    if not tie:
        sd["lm_head.weight"] = ours.output.weight
    for i, layer in ours.layers.items():
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": _hf_permute(layer.attention.wq.weight, args.n_heads),
            p + "self_attn.k_proj.weight": _hf_permute(layer.attention.wk.weight, args.n_kv_heads),
            p + "self_attn.v_proj.weight": layer.attention.wv.weight,
            p + "self_attn.o_proj.weight": layer.attention.wo.weight,
            p + "mlp.gate_proj.weight": layer.feed_forward.w1.weight,
            p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
            p + "mlp.up_proj.weight": layer.feed_forward.w3.weight,
            p + "input_layernorm.weight": layer.attention_norm.weight,
            p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
        })
    missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = torch.randint(0, args.vocab_size, (2, 48))  # past original_max_seq_len: scaling matters
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_init_is_deterministic_per_seed_and_name():
    a, b, c = tiny_model(seed=1), tiny_model(seed=1), tiny_model(seed=2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n
    wo0, wo1 = a.layers["0"].attention.wo.weight, a.layers["1"].attention.wo.weight
    assert wo1.std() < wo0.std()  # depth-scaled residual init


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta(name: str):
    """No preset allocates a parameter while it is built (the 405B one would need 1.6 TB)."""
    args = PRESETS[name]
    model = build_model(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    attention = model.layers["0"].attention
    if args.mla:  # the latent and the shared RoPE key; each head's no-RoPE key and value from the latent
        assert attention.wkv_a.weight.shape == (args.kv_lora_rank + args.qk_rope_head_dim, args.dim)
        assert attention.wkv_b.weight.shape == (args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                                                args.kv_lora_rank)
    else:
        assert attention.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    out = model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert out.shape == (1, 8, args.vocab_size)


def test_meta_build_materializes_to_the_cpu_build():
    """Built on meta (no initializers run, the RoPE table a shape only), moved to the CPU and
    initialized: every parameter and the RoPE table equal the model built and initialized on the CPU."""
    args = dataclasses.replace(TINY_MODEL, n_experts=4, moe_top_k=2, moe_hidden_dim=32, n_dense_layers=1)
    meta = build_model(args)
    assert meta.rope.is_meta
    meta.to_empty(device="cpu")
    cpu = build_model(args, device="cpu")
    init_weights(meta, 7)
    init_weights(cpu, 7)
    assert torch.equal(meta.rope, rope_table(args)) and torch.equal(cpu.rope, rope_table(args))
    for (n, a), (_, b) in zip(meta.state_dict().items(), cpu.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name,billions", [("1b", 1.236), ("3b", 3.213), ("8b", 8.030), ("70b", 70.554),
                                           ("405b", 405.853)])
def test_large_presets_have_published_parameter_counts(name: str, billions: float):
    assert num_params(PRESETS[name]) / 1e9 == pytest.approx(billions, rel=2e-3)


def test_deepseek_presets_have_published_sizes():
    """DeepSeek-V3's technical report: 671B parameters, 37B activated per token (the main model,
    without its multi-token-prediction module); the 16B preset (torchtitan's shape): 15.7B, 2.66B."""
    assert num_params(PRESETS["deepseek-v3-671b"]) / 1e9 == pytest.approx(671.0, rel=1e-3)
    assert num_params(PRESETS["deepseek-v3-671b"], active=True) / 1e9 == pytest.approx(37.6, rel=5e-3)
    assert num_params(PRESETS["deepseek-v3-16b"]) / 1e9 == pytest.approx(15.7, rel=2e-3)
    assert num_params(PRESETS["deepseek-v3-16b"], active=True) / 1e9 == pytest.approx(2.66, rel=5e-3)


def test_qwen3_small_preset_has_its_published_sizes():
    """Qwen3-0.6B's model card: 0.6B parameters, 0.44B without the (tied) embedding."""
    args = PRESETS["qwen3-0.6b"]
    assert args.qk_norm and args.tie_embeddings and args.head_dim == 128 and args.ffn_hidden_dim == 3072
    assert num_params(args) / 1e9 == pytest.approx(0.6, rel=1e-2)
    assert num_params(args, include_embedding=False) / 1e9 == pytest.approx(0.44, rel=1e-2)


def test_cross_entropy_reference_on_logits():
    """The trainer's loss is the standard one: sum over valid tokens of -log softmax."""
    model = tiny_model()
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 8))
    labels = torch.randint(0, TINY_MODEL.vocab_size, (2, 8))
    logits = model(tokens)
    manual = -torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).sum()
    ours = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    torch.testing.assert_close(ours.double(), manual, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("path", ["cpu", "sdpa"])
def test_context_parallel_document_pieces_equal_the_dense_mask(balanced, path):
    """One cp rank's share of document-masked attention (its head-tail chunks, or one chunk, of a
    window whose documents cross the chunk edges) against the gathered keys equals the dense mask's
    rows at its positions, forward and gradients (fp32, 1e-5): the CPU flash pieces and the SDPA
    pieces (lower-right causal bias) the GPU path runs."""
    from shardwise.parallel import context

    s, cp = 256, 2  # chunks of 64: documents cross them, with earlier keys of every length class
    docs = _doc_ids(2, s, [[5, 150, 101], [256]])
    chunks = torch.arange(s).view(2 * cp, -1)

    def held(r: int) -> torch.Tensor:  # rank r's positions: head-tail chunks, or one contiguous run
        return torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) if balanced else chunks.view(cp, -1)[r]

    every = torch.cat([held(r) for r in range(cp)])
    for rank in range(cp):
        positions = held(rank)
        spans = context.RingDocuments.of(docs, positions, every, group=None)
        gen = torch.Generator().manual_seed(rank)
        q = torch.randn(2, 4, len(positions), 16, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, 2, s, 16, generator=gen, requires_grad=True) for _ in range(2))
        weight = torch.randn(2, 4, len(positions), 16, generator=gen)
        fn = context._PiecesCPU.apply if path == "cpu" else context._pieces_sdpa
        out = fn(q, k, v, spans.pieces, 0.3)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        mask = document_mask(docs)[:, :, positions]  # (B, 1, S/cp, S): this rank's query rows
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
        ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
