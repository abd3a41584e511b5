"""Chunked linear + cross-entropy against F.cross_entropy on materialized logits: loss and the
gradients of hidden states and weight, fp32 and bf16, every reduction, with ignored tokens."""

from __future__ import annotations

import pytest
import torch

from shardwise.ops.chunked_ce import chunked_linear_cross_entropy, reference_linear_cross_entropy
from tests.references import IGNORE, loss_inputs, run_loss


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("chunk", [1, 7, 64])  # a chunk per token, uneven chunks, one chunk
def test_matches_cross_entropy_on_full_logits_fp32(reduction: str, chunk: int):
    hidden, weight, labels = loss_inputs(torch.float32)
    got = run_loss(chunked_linear_cross_entropy, hidden, weight, labels, reduction, chunk_size=chunk)
    want = run_loss(reference_linear_cross_entropy, hidden, weight, labels, reduction)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # summation order only
    if reduction == "none":
        assert (got[0][labels == IGNORE] == 0).all()
        assert (got[1][labels == IGNORE] == 0).all()  # ignored tokens get no gradient


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_bf16_is_as_accurate_as_cross_entropy_on_full_logits(reduction: str, chunk: int):
    """bf16 inputs: loss and gradients stay within 2x the plain bf16 computation's own distance from
    the float64 truth (each chunk's weight-gradient matmul rounds to bf16 before the fp32 sum:
    measured up to 1.5x)."""
    hidden, weight, labels = loss_inputs(torch.bfloat16)
    got = run_loss(chunked_linear_cross_entropy, hidden, weight, labels, reduction, chunk_size=chunk)
    plain = run_loss(reference_linear_cross_entropy, hidden, weight, labels, reduction)
    exact = run_loss(reference_linear_cross_entropy, hidden.double(), weight.double(), labels, reduction)
    for name, g, p, e in zip(("loss", "d hidden", "d weight"), got, plain, exact, strict=True):
        err = (g.double() - e).abs().max().item()
        ref_err = (p.double() - e).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, (name, err, ref_err)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16


@pytest.mark.parametrize("reduction", ["sum", "none"])  # gradients in forward; recomputed in backward
@pytest.mark.parametrize("chunk", [7, 64])
def test_under_autocast_it_is_the_bf16_loss_with_fp32_gradients(reduction: str, chunk: int):
    """fp32 hidden states and weight under ``torch.autocast`` (bf16), as one GPU's default feeds it
    (fp32 parameters, no FSDP): the loss is the bf16 computation's to the bit, the hidden states'
    gradient that one's upcast, and the weight's fp32 -- within bf16's rounding of the bf16 path's,
    and as accurate against the float64 truth -- where autocast alone would have cast the fp32
    accumulator and left the backward's products mismatched."""
    hidden, weight, labels = loss_inputs(torch.float32)

    def autocast_forward(*args, **kwargs) -> torch.Tensor:  # backward outside autocast, as in training
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chunked_linear_cross_entropy(*args, **kwargs)
    got = run_loss(autocast_forward, hidden, weight, labels, reduction, chunk_size=chunk)
    bf16 = run_loss(chunked_linear_cross_entropy, hidden.bfloat16(), weight.bfloat16(), labels, reduction,
                    chunk_size=chunk)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], bf16[0])
    assert got[1].dtype == torch.float32 and torch.equal(got[1], bf16[1].float())
    assert got[2].dtype == torch.float32
    torch.testing.assert_close(got[2], bf16[2].float(), rtol=2**-7, atol=1e-6)
    exact = run_loss(reference_linear_cross_entropy, hidden.bfloat16().double(), weight.bfloat16().double(),
                     labels, reduction)
    assert (got[2].double() - exact[2]).abs().max() <= (bf16[2].double() - exact[2]).abs().max() + 1e-6


def test_global_token_normalization_is_exact_across_splits():
    """What the trainer does: per-call summed loss / valid tokens of the whole batch. Splitting the
    batch in two calls (data parallel, accumulation) gives the gradient of the one-call mean --
    unlike averaging per-call means, the bug TransformerEngine had to fix in its fused CE."""
    hidden, weight, labels = loss_inputs(torch.float32, n=40)
    n_valid = (labels != IGNORE).sum()

    def grads(parts: list[slice]) -> torch.Tensor:
        w = weight.clone().requires_grad_()
        for sl in parts:
            (chunked_linear_cross_entropy(hidden[sl], w, labels[sl], reduction="sum",
                                          ignore_index=IGNORE, chunk_size=8) / n_valid).backward()
        return w.grad

    w = weight.clone().requires_grad_()
    reference_linear_cross_entropy(hidden, w, labels, reduction="mean", ignore_index=IGNORE).backward()
    torch.testing.assert_close(grads([slice(0, 1), slice(1, 2)]), w.grad, rtol=1e-5, atol=1e-7)
    # Averaging per-call means is a different (wrong) gradient when the calls' valid counts differ.
    w2 = weight.clone().requires_grad_()
    for sl in (slice(0, 1), slice(1, 2)):
        (chunked_linear_cross_entropy(hidden[sl], w2, labels[sl], ignore_index=IGNORE) / 2).backward()
    assert not torch.allclose(w2.grad, w.grad, rtol=1e-4)


def test_logits_never_materialize():
    """Peak memory of the chunked op's forward+backward stays near one chunk's logits: track every
    tensor allocated through the dispatcher and compare the largest with N x V."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out

    n, d, v = 512, 16, 1000
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with Largest():
        chunked_linear_cross_entropy(hidden, weight, labels, reduction="sum", chunk_size=64).backward()
    assert Largest.biggest <= 64 * v  # one chunk of logits, never n x v
    assert Largest.biggest < n * v / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_softmax_pass_matches_eager_and_plain(dtype: torch.dtype):
    """The fused loss with its softmax-gradient pass through torch.compile (what a compiled run
    uses) against the eager pass and against plain cross-entropy on full logits."""
    hidden, weight, labels = loss_inputs(dtype, n=64)
    got = run_loss(chunked_linear_cross_entropy, hidden, weight, labels, "sum", chunk_size=16, compiled=True)
    eager = run_loss(chunked_linear_cross_entropy, hidden, weight, labels, "sum", chunk_size=16)
    plain = run_loss(reference_linear_cross_entropy, hidden, weight, labels, "sum")
    exact = run_loss(reference_linear_cross_entropy, hidden.double(), weight.double(), labels, "sum")
    for name, g, e, p, x in zip(("loss", "d hidden", "d weight"), got, eager, plain, exact, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(g, p, rtol=1e-5, atol=1e-6)
        else:  # same bound as the eager pass: within 2x plain bf16's own distance from float64
            err, ref_err = (g.double() - x).abs().max().item(), (p.double() - x).abs().max().item()
            assert err <= 2 * ref_err + 1e-6, (name, err, ref_err)
        torch.testing.assert_close(g, e, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_summed_loss_computes_the_head_once():
    """Gradients in forward: three matmuls per chunk in all (logits, d hidden, d weight), none in
    backward -- the per-token path recomputes the logits (four)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                CountMM.calls += 1
            return func(*args, **(kwargs or {}))

    hidden, weight, labels = loss_inputs(torch.float32, n=64)
    for reduction, want in (("sum", 3 * 4), ("none", 4 * 4)):
        CountMM.calls = 0
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with CountMM():
            chunked_linear_cross_entropy(h, w, labels, reduction, IGNORE, chunk_size=16).sum().backward()
        assert CountMM.calls == want, reduction


def test_evaluation_loss_equals_the_training_loss():
    """Without a gradient (evaluation) the forward-only path gives the same summed loss."""
    hidden, weight, labels = loss_inputs(torch.bfloat16, n=64)
    train = chunked_linear_cross_entropy(hidden.requires_grad_(), weight, labels, "sum", IGNORE, 16)
    with torch.no_grad():
        evaluation = chunked_linear_cross_entropy(hidden, weight, labels, "sum", IGNORE, 16)
    torch.testing.assert_close(train.detach(), evaluation, rtol=1e-6, atol=1e-6)
