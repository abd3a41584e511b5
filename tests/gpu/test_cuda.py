"""The CUDA paths, on a GPU machine: ``pytest -m gpu tests/gpu``.

``make test`` deselects these (marker ``gpu``); ``make test-all`` on a machine without a CUDA device
lists them as skipped with that reason. Each checks a path that only exists on CUDA against the
plain computation: the fp32-output GEMM that accumulates the fused loss's weight gradient, the fused
loss itself, the compiled RoPE, float8 (tensorwise and rowwise, real ``_scaled_mm`` kernels) and the
trainer's whole step against an independent one (tests/unit/test_train_step.py's reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from shardwise.models import PRESETS
from shardwise.models.transformer import apply_rope, build_model, init_weights, rope_table
from shardwise.ops.chunked_ce import _addmm_fp32, chunked_linear_cross_entropy, reference_linear_cross_entropy
from shardwise.trainer.loss import TokenLoss
from shardwise.trainer.train import train_step
from tests.references import (
    AMP_MOE,
    STEPS,
    Reference,
    check_torch_amp,
    hf_params,
    loss_inputs,
    run_loss,
    step_trainer,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@contextlib.contextmanager
def one_rank_nccl() -> Iterator[None]:
    """A one-rank group with NCCL for CUDA tensors (FSDP's collectives) and gloo for CPU ones."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"file://{os.path.join(d, 'pg')}",
                                rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_weight_gradient_accumulates_in_fp32_in_place():
    """bf16 inputs, fp32 result written by the GEMM itself into the accumulator (same storage)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1024, 96, device="cuda", generator=g).bfloat16()
    b = torch.randn(96, 320, device="cuda", generator=g).bfloat16()
    acc = _addmm_fp32(None, a, b)
    assert acc.dtype == torch.float32
    ptr = acc.data_ptr()
    for _ in range(3):
        acc = _addmm_fp32(acc, a, b)
    assert acc.data_ptr() == ptr
    want = 4 * (a.double() @ b.double())  # bf16 products are exact in fp32 accumulation's range
    assert ((acc.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("reduction", ["sum", "none"])  # gradients in forward; recomputed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_on_cuda_matches_cross_entropy(dtype: torch.dtype, reduction: str):
    """Several chunks, so the fp32 accumulation across them is exercised: fp32 equal up to summation
    order; bf16 within 2x the plain bf16 computation's own distance from float64 (the CPU bound)."""
    hidden, weight, labels = (t.cuda() for t in loss_inputs(dtype, n=200, d=64, v=1000))
    got = run_loss(chunked_linear_cross_entropy, hidden, weight, labels, reduction, chunk_size=24)
    plain = run_loss(reference_linear_cross_entropy, hidden, weight, labels, reduction)
    exact = run_loss(reference_linear_cross_entropy, hidden.double(), weight.double(), labels, reduction)
    for name, g, p, e in zip(("loss", "d hidden", "d weight"), got, plain, exact, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(g, p, rtol=1e-4, atol=1e-5)
        else:
            err = (g.double() - e).abs().max().item()
            ref_err = (p.double() - e).abs().max().item()
            assert err <= 2 * ref_err + 1e-6, (name, err, ref_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_matches_eager_on_cuda(dtype: torch.dtype):
    args = dataclasses.replace(PRESETS["debug"], max_seq_len=256)
    rope = rope_table(args, device="cuda")[:256]
    x = torch.randn(2, 256, 4, args.head_dim, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    results = []
    for fn in (apply_rope, torch.compile(apply_rope, fullgraph=True)):
        out = fn(x, rope)
        results.append((out, *torch.autograd.grad(out, x, grad)))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, **tol)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_on_cuda_is_close_to_bf16(recipe: str):
    """Real float8 GEMMs (torch._scaled_mm on the tensor cores): loss within 1% of bf16, gradients
    within 15% (the CPU's emulated bounds are 0.2% and 15% on a smaller model)."""
    pytest.importorskip("torchao")
    from shardwise.config.schema import Float8Config
    from shardwise.parallel.float8 import apply_float8, is_float8

    args = dataclasses.replace(PRESETS["debug"], max_seq_len=512)
    tokens = torch.randint(0, args.vocab_size, (4, 512), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    losses, grads = [], []
    for f8 in (False, True):
        m = build_model(args, device="cuda")
        init_weights(m, 0)
        if f8:
            apply_float8(m, Float8Config(enabled=True, recipe=recipe), 1, "cuda")
            assert sum(is_float8(mod) for mod in m.modules()) == 7 * args.n_layers
        m.to(torch.bfloat16)
        init_weights(m, 0)  # the same weights (and the fp32 RoPE table) after the cast
        logits = m(tokens).flatten(0, 1).float()
        loss = torch.nn.functional.cross_entropy(logits, tokens.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    assert abs(losses[1] - losses[0]) / losses[0] < 1e-2, losses
    for name, g in grads[0].items():
        assert ((grads[1][name] - g).norm() / g.norm()).item() < 0.15, name


@pytest.mark.parametrize("loss", ["auto", "plain"])
def test_trainer_step_on_cuda_matches_a_plain_pytorch_step(data_cache: str, loss: str):
    """tests/unit/test_train_step.py on the GPU: FSDP2 over NCCL, the fused AdamW kernel, the fused
    loss's CUDA GEMMs, against Hugging Face's Llama with a step written out (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with one_rank_nccl():
        cfg, args, run, model, optimizer, scheduler, loader = step_trainer(data_cache, loss, device="cuda")
        assert run.device_type == "cuda" and (run.loss_chunk > 0) == (loss == "auto")
        ref = Reference(model, args, cfg.lr_scheduler.min_lr_ratio)
        for step in range(1, STEPS + 1):
            batches = loader.next_step()
            got = train_step(model, optimizer, scheduler, batches, run, TokenLoss(run.loss_chunk))
            want_loss, norm, lr, _ = ref.step(batches, step)
            assert float(got.loss) == pytest.approx(want_loss, rel=1e-5), step
            assert float(got.grad_norm) == pytest.approx(norm, rel=1e-4), step
        ours = hf_params(model, args)
        for name, p in ref.hf.named_parameters():
            err = (ours[name] - p.detach()).norm() / (p.detach() - ref.start[name]).norm()
            assert err <= 1e-3, f"{name}: {err:.2e} of the update"


@pytest.mark.parametrize("model", [(), AMP_MOE], ids=["dense", "moe"])
def test_one_gpu_without_fsdp_is_torch_amp(data_cache: str, model: tuple[str, ...]):
    """One GPU's default (parallel.one_rank auto = plain): the trainer's step against torch's AMP written
    out by hand on CUDA (autocast, the fused AdamW kernel with its clip and skip flags, the grouped
    GEMMs of the experts cast by hand) -- tests/unit/test_train_step.py's check on the GPU."""
    with one_rank_nccl():
        check_torch_amp(data_cache, model, "cuda")


def test_a_rank_forked_from_the_rank_server_can_use_cuda():
    """``--nproc N`` forks its ranks from a server that imported shardwise.launch.process.RANK_MODULES; CUDA
    survives a fork only if the parent never initialized it. A fresh process imports exactly those
    modules, forks, and the child runs a CUDA kernel (passed on one H100, 2026-11-26)."""
    import subprocess
    import sys

    code = """
import importlib, os
import torch
from shardwise.launch.process import RANK_MODULES
for name in RANK_MODULES:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
assert not torch.cuda.is_initialized()
pid = os.fork()
if pid == 0:
    x = torch.ones(1024, device="cuda")
    os._exit(0 if x.sum().item() == 1024 else 3)
raise SystemExit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_generation_on_cuda_matches_the_cpu_and_its_cache():
    """shardwise generate's decoding on CUDA: fp32 greedy tokens equal the CPU's on the same weights;
    in bf16 the cached logits equal recomputing the sequence's within bf16's rounding."""
    from shardwise.infer.generate import Sampling, generate
    from shardwise.models.transformer import KVCache

    args = dataclasses.replace(PRESETS["debug"], n_layers=2, max_seq_len=256)
    cpu = build_model(args, device="cpu")
    init_weights(cpu, 5)
    cpu.eval()
    gpu = build_model(args, device="cpu")
    init_weights(gpu, 5)
    gpu = gpu.cuda().eval()
    gpu.rope = gpu.rope.cuda()
    s = Sampling(max_new_tokens=32)
    prompt = list(range(3, 40))
    assert generate(gpu, prompt, s, set()) == generate(cpu, prompt, s, set())
    gpu = gpu.bfloat16()
    gpu.rope = gpu.rope.float()
    tokens = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        full = gpu(tokens).float()
        cache = KVCache(len(prompt))
        parts = [gpu(tokens[:, :20], cache=cache)] + [gpu(tokens[:, i:i + 1], cache=cache)
                                                      for i in range(20, len(prompt))]
    torch.testing.assert_close(torch.cat(parts, dim=1).float(), full, rtol=3e-2, atol=3e-2)
