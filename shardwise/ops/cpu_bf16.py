"""bf16 products on a CPU without bf16 arithmetic (x86 without AVX512-BF16 or AMX).

There torch's CPU kernels for bf16 ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` run 6-9x slower than
the fp32 GEMM of the same shape as ``a @ b.T`` (a linear layer's forward) and 65-390x as ``a @ b``
(its gradients), widths 256-2048 on an AVX2 EPYC (bench/cpu_bf16.py, BENCHMARKS.md). A bf16
GEMM's result is its bf16 inputs' products summed in fp32 and rounded once to bf16; a product of two
bf16 values is exact in fp32, so an fp32 GEMM of the upcast inputs, rounded once, computes the same
result up to the order of the fp32 sums -- which differs between any two GEMM kernels. This module
registers such kernels for those four ops on torch's CPU dispatch key, for bf16 inputs only (other
dtypes run the ops' own ``out=`` kernels), once per process and only where the CPU lacks bf16
arithmetic: the run's bf16 semantics are unchanged, its GEMMs run at the fp32 rate.
Attention there runs in fp32 on the bf16 values (models.layers.AttentionCore asks
:func:`fp32_gemms_for_bf16`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardwise.runtime.machine import bf16_without_arithmetic

BF16 = torch.bfloat16
_LIBRARY: torch.library.Library | None = None


def _kernel(op: Callable[..., torch.Tensor], batched: bool) -> Callable[..., torch.Tensor]:
    """The CPU kernel of ``op`` (``mm``/``addmm``, or with ``batched`` ``bmm``/``baddbmm``; the
    product's operands last): bf16 operands as one fp32 product rounded once, other dtypes through the
    op's own ``out=`` kernel."""
    def kernel(*args: torch.Tensor, **scalars: Any) -> torch.Tensor:
        if all(t.dtype == BF16 for t in args):
            return op(*(t.float() for t in args), **scalars).to(BF16)
        a, b = args[-2:]
        shape = (a.shape[0], a.shape[1], b.shape[2]) if batched else (a.shape[0], b.shape[1])
        return op(*args, **scalars, out=a.new_empty(shape, dtype=torch.result_type(a, b)))
    return kernel


KERNELS = {"mm": _kernel(torch.mm, False), "addmm": _kernel(torch.addmm, False),
           "bmm": _kernel(torch.bmm, True), "baddbmm": _kernel(torch.baddbmm, True)}
"""The ops whose CPU kernel :func:`use_fp32_gemms_for_bf16` replaces (each op's default overload)."""


def use_fp32_gemms_for_bf16(device_type: str, precision: str) -> bool:
    """On a CPU without bf16 arithmetic and a bf16 run, run bf16 GEMMs as fp32 GEMMs of their inputs
    rounded once (see the module docstring), for the rest of the process; returns whether they run
    so. Elsewhere (GPUs, CPUs with AMX or AVX512-BF16, fp32 runs) nothing changes."""
    if not bf16_without_arithmetic(device_type, precision):
        return fp32_gemms_for_bf16()
    install()
    return True


def fp32_gemms_for_bf16() -> bool:
    """Whether this process runs bf16 GEMMs as fp32 ones."""
    return _LIBRARY is not None


def install() -> bool:
    """Register the kernels (whatever the CPU); False if they already were."""
    global _LIBRARY
    if _LIBRARY is not None:
        return False
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel it has is overridden: intended here
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in KERNELS.items():
            library.impl(name, kernel, "CPU")
    _LIBRARY = library
    return True


def remove() -> None:
    """Give the ops their own CPU kernels back."""
    global _LIBRARY
    if _LIBRARY is not None:
        _LIBRARY._destroy()  # (torch.library has no public way to take a kernel back)
        _LIBRARY = None


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """Within: the kernels registered (whatever the CPU); after: as before."""
    here = install()
    try:
        yield
    finally:
        if here:
            remove()


def bf16_gemms_as_runs_make_them(precision: str) -> contextlib.AbstractContextManager:
    """Within: a ``precision`` run's GEMMs as this CPU's runs make them (for a measurement of them:
    ``shardwise calibrate``); after: as before, so that the fp32 measurements beside it pay no
    Python kernel per product."""
    if bf16_without_arithmetic("cpu", precision):
        return registered()
    return contextlib.nullcontext()
