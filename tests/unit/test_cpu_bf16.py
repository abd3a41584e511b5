"""bf16 GEMMs as fp32 GEMMs of the bf16 values on CPUs without bf16 arithmetic (shardwise.ops.cpu_bf16):
against torch's own bf16 kernels and the exact product, forward and gradients, on any CPU. The checks
that register the kernels run in a fresh interpreter (:func:`_fresh`), so this process's ops stay
torch's for the tests after these."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shardwise.ops import cpu_bf16
from tests.helpers import ROOT

BF = torch.bfloat16


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of bf16's spacing at ``exact`` (2^-7 of its power of two)."""
    spacing = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 8)
    return (got.double() - exact).abs() / spacing


def _products() -> dict[str, tuple]:
    """Each op on bf16 operands: plain, transposed (non-contiguous), with scalars, broadcast bias."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 80, generator=g).to(BF), torch.randn(80, 72, generator=g).to(BF)
    c, bias = torch.randn(96, 72, generator=g).to(BF), torch.randn(72, generator=g).to(BF)
    x, y = torch.randn(3, 40, 48, generator=g).to(BF), torch.randn(3, 48, 24, generator=g).to(BF)
    z = torch.randn(3, 40, 24, generator=g).to(BF)
    return {"mm": (torch.mm, a, b), "mm_t": (torch.mm, b.t(), a.t()),
            "addmm": (lambda *t: torch.addmm(*t, beta=0.5, alpha=2.0), c, a, b),
            "addmm_bias": (torch.addmm, bias, a, b),
            "bmm": (torch.bmm, x, y), "bmm_expanded": (torch.bmm, x[:1].expand(3, -1, -1), y),
            "baddbmm": (lambda *t: torch.baddbmm(*t, beta=0.25, alpha=1.5), z, x, y)}


def _exact(name: str, fn, *args: torch.Tensor) -> torch.Tensor:
    return fn(*(t.double() for t in args))


def _fresh(*checks: str) -> None:
    """Run this module's ``checks`` (functions) in a new interpreter; fail with its stderr."""
    code = "import tests.unit.test_cpu_bf16 as m\n" + "".join(f"m.{c}()\n" for c in checks)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def check_each_product_is_the_bf16_rounding_of_the_exact_one() -> None:
    """Every entry within one bf16 spacing of the exact (fp64) result -- what one rounding of a sum
    kept in fp32 gives -- and equal to torch's own bf16 kernel in all but a few entries (their fp32
    sums run in other orders)."""
    for name, (fn, *args) in _products().items():
        own = fn(*args)
        with cpu_bf16.registered():
            ours = fn(*args)
        assert not cpu_bf16.fp32_gemms_for_bf16()  # (taken back)
        exact = _exact(name, fn, *args)
        assert ours.dtype == BF and ours.shape == own.shape, name
        assert _ulps(ours, exact).max() <= 1.0, name
        assert (ours != own).float().mean() < 0.02, name


def check_other_dtypes_run_the_ops_own_kernels() -> None:
    """fp32 products with the kernels registered are bit-identical to torch's; mixed dtypes still
    fail as they do without them."""
    g = torch.Generator().manual_seed(1)
    a, b, c = torch.randn(33, 17, generator=g), torch.randn(17, 9, generator=g), torch.randn(9, generator=g)
    x, y = torch.randn(2, 5, 7, generator=g), torch.randn(2, 7, 3, generator=g)

    def products() -> list[torch.Tensor]:
        return [torch.mm(a, b), torch.addmm(c, a, b), torch.bmm(x, y), torch.baddbmm(x[:, :, :3], x, y)]
    before = products()
    with cpu_bf16.registered():
        after = products()
        with pytest.raises(RuntimeError):
            torch.mm(a.to(BF), b)
    assert all(torch.equal(p, q) for p, q in zip(before, after, strict=True))


def check_a_linear_layers_gradients_match_torchs_bf16() -> None:
    """Forward and backward of a bf16 linear layer with bias (addmm forward, mm backward): the output
    and every gradient as torch's bf16 kernels give them, within one bf16 spacing."""
    g = torch.Generator().manual_seed(2)
    x0, w0, b0 = (torch.randn(*s, generator=g).to(BF) for s in ((64, 48), (32, 48), (32,)))
    grad = torch.randn(64, 32, generator=g).to(BF)

    def run() -> list[torch.Tensor]:
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        out = F.linear(x, w, b)
        out.backward(grad)
        return [out, x.grad, w.grad, b.grad]

    own = run()
    with cpu_bf16.registered():
        ours = run()
    for p, q in zip(own, ours, strict=True):
        assert q.dtype == BF
        torch.testing.assert_close(q, p, rtol=2**-7, atol=1e-2)


def check_grouped_expert_products_take_the_fp32_gemm_too() -> None:
    """The MoE experts' grouped product (models.moe.grouped_mm) on bf16 rows: with the kernels
    registered it runs in fp32 and rounds once -- within one spacing of the exact product."""
    from shardwise.models.moe import grouped_mm

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 16, generator=g).to(BF), torch.randn(3, 16, 8, generator=g).to(BF)
    counts = torch.tensor([8, 24, 8])
    exact = torch.cat([xi.double() @ w[i].double() for i, xi in enumerate(torch.split(x, [8, 24, 8]))])
    with cpu_bf16.registered():
        ours = grouped_mm(x, w, counts)
    assert ours.dtype == BF and _ulps(ours, exact).max() <= 1.0


def _attention(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, grad: torch.Tensor,
               spans: object = None, exact: bool = False) -> list[torch.Tensor]:
    """Causal grouped-query attention's output and gradients: the model's core, or in fp64 math."""
    from shardwise.models.layers import AttentionCore

    q, k, v = ((t.double() if exact else t.clone()).requires_grad_() for t in (q0, k0, v0))
    if exact:
        s = q.shape[2]
        logits = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, S, S)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        out = logits.masked_fill(~causal, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    else:
        out = AttentionCore()(q, k, v, spans)
    out.backward(grad.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def check_attention_runs_in_fp32_on_the_bf16_values() -> None:
    """With the kernels registered, bf16 attention (causal and per document) runs torch's fp32 flash
    kernel on the bf16 values and rounds once: the output within one bf16 spacing of the exact one,
    each gradient within 2^-9 of the exact one (relative norm: rounding's floor) and nearer than
    torch's bf16 kernel; fp32 attention is untouched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.models.layers import DocumentSpans

    class Flash(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if "flash_attention" in func.__name__:
                self.dtypes.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(4)
    q, k, v, grad = (torch.randn(2, h, 64, 16, generator=g).to(BF) for h in (4, 2, 2, 4))
    exact, own = _attention(q, k, v, grad, exact=True), _attention(q, k, v, grad)
    with cpu_bf16.registered(), Flash() as flash:
        ours = _attention(q, k, v, grad)
    assert flash.dtypes == {torch.float32}
    assert all(t.dtype == BF for t in ours) and _ulps(ours[0], exact[0]).max() <= 1.0
    for e, theirs, mine in zip(exact, own, ours, strict=True):
        err = [float((t.double() - e).norm() / e.norm()) for t in (theirs, mine)]
        assert err[1] <= min(err[0], 2**-9), err
    spans = DocumentSpans((20, 44, 64), 2, 64)
    with cpu_bf16.registered(), Flash() as flash:
        by_document = _attention(q, k, v, grad, spans)
    assert flash.dtypes == {torch.float32}
    by_document_fp32 = _attention(*(t.float() for t in (q, k, v, grad)), spans)
    for mine, wide in zip(by_document, by_document_fp32, strict=True):
        assert mine.dtype == BF and torch.equal(mine, wide.to(BF))
    with cpu_bf16.registered(), Flash() as flash:
        _attention(*(t.float() for t in (q, k, v, grad)))
    assert flash.dtypes == {torch.float32}


def check_runs_take_them_only_on_a_cpu_without_bf16_arithmetic() -> None:
    """A bf16 run on a CPU without bf16 arithmetic takes the kernels; fp32 runs, GPUs and CPUs with
    AMX / AVX512-BF16 keep torch's (the decision of ``use_fp32_gemms_for_bf16``)."""
    from shardwise.runtime import machine

    assert not cpu_bf16.fp32_gemms_for_bf16()
    machine.cpu_has_native_bf16 = lambda: True
    assert not cpu_bf16.use_fp32_gemms_for_bf16("cpu", "bf16")
    machine.cpu_has_native_bf16 = lambda: False
    assert not cpu_bf16.use_fp32_gemms_for_bf16("cpu", "fp32")
    assert not cpu_bf16.use_fp32_gemms_for_bf16("cuda", "bf16")
    assert not cpu_bf16.fp32_gemms_for_bf16()
    try:
        assert cpu_bf16.use_fp32_gemms_for_bf16("cpu", "bf16") and cpu_bf16.fp32_gemms_for_bf16()
        assert cpu_bf16.use_fp32_gemms_for_bf16("cpu", "bf16")  # (once per process: no second library)
    finally:
        cpu_bf16.remove()
    assert not cpu_bf16.fp32_gemms_for_bf16()


def check_the_registered_kernels_are_what_runs() -> None:
    """With the kernels registered, a bf16 linear layer and a batched product dispatch to them."""
    calls = []
    for name, kernel in list(cpu_bf16.KERNELS.items()):
        def counted(*args, _kernel=kernel, _name=name, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls.append(_name)
            return _kernel(*args, **kwargs)
        cpu_bf16.KERNELS[name] = counted
    x, w, b = torch.ones(4, 8, dtype=BF), torch.ones(2, 8, dtype=BF), torch.ones(2, dtype=BF)
    with cpu_bf16.registered():
        F.linear(x, w, b)
        torch.bmm(x[None], w.t()[None])
        torch.mm(x.float(), w.t().float())
    assert calls == ["addmm", "addmm", "bmm", "bmm", "mm"]  # (a bf16 call runs the op again in fp32)


def test_bf16_asked_for_on_such_a_cpu_is_kept_with_one_notice(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture):
    """training.mixed_precision=bf16 on a CPU without bf16 arithmetic stays bf16 and says once how it
    runs there; ``auto`` picks fp32 there and says nothing."""
    import shardwise.runtime.machine as machine
    from shardwise.resolve import checks
    from tests.helpers import resolved_config

    monkeypatch.setattr(machine, "cpu_has_native_bf16", lambda: False)
    checks._bf16_notice.cache_clear()
    try:
        def precision(asked: str) -> str:
            return resolved_config(None, [f"--training.mixed_precision={asked}"], device="cpu").training \
                .mixed_precision
        assert precision("auto") == "fp32"
        assert "notice: training.mixed_precision=bf16" not in capsys.readouterr().out
        assert precision("bf16") == precision("bf16") == "bf16"
        out = capsys.readouterr().out
        assert out.count("notice: training.mixed_precision=bf16 on a CPU without bf16 arithmetic") == 1, out
        assert resolved_config(None, ["--training.mixed_precision=bf16"], device="cuda")
        assert "notice" not in capsys.readouterr().out
    finally:
        checks._bf16_notice.cache_clear()


def check_mfu_of_such_runs_is_against_the_peak_they_run_at() -> None:
    """The bf16 GEMM peak MFU divides by is measured with the kernels the run uses and cached apart
    from torch's own (a peak of torch's kernels put such a run's MFU over 100%)."""
    import tempfile

    from shardwise.observe import peak as peak_mod

    peak_mod.measure_peak = lambda dtype, device: 0.1 if cpu_bf16.fp32_gemms_for_bf16() else 0.001
    cpu, where = torch.device("cpu"), tempfile.mkdtemp()
    assert peak_mod.peak_tflops(cpu, "bf16", cache_dir=where)[0] == 0.001
    with cpu_bf16.registered():
        assert peak_mod.peak_tflops(cpu, "bf16", cache_dir=where)[0] == 0.1
    assert peak_mod.peak_tflops(cpu, "bf16", cache_dir=where)[0] == 0.001  # (both cached)


CHECKS = [name for name in dir() if name.startswith("check_")]


def test_the_kernels_registered_in_a_fresh_interpreter():
    """Every ``check_*`` above (the products against the exact ones and torch's, fp32 untouched,
    a linear layer's gradients, the grouped expert product, attention, which runs take the kernels, that they
    are what runs, the MFU peak), in one new interpreter, in order; the later checks patch module
    attributes, so they run last."""
    order = ["check_each_product_is_the_bf16_rounding_of_the_exact_one",
             "check_other_dtypes_run_the_ops_own_kernels",
             "check_a_linear_layers_gradients_match_torchs_bf16",
             "check_grouped_expert_products_take_the_fp32_gemm_too",
             "check_attention_runs_in_fp32_on_the_bf16_values",
             "check_mfu_of_such_runs_is_against_the_peak_they_run_at",
             "check_the_registered_kernels_are_what_runs",
             "check_runs_take_them_only_on_a_cpu_without_bf16_arithmetic"]
    assert sorted(order) == sorted(CHECKS)
    _fresh(*order)
