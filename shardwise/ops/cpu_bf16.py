"""bf16 products on a CPU without bf16 arithmetic (x86 without AVX512-BF16 or AMX).

There torch's CPU kernels for bf16 ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` fall back to a scalar
loop about 100x slower than the fp32 GEMM of the same shape (bench/results/history.md). A bf16
GEMM's result is its bf16 inputs' products summed in fp32 and rounded once to bf16; a product of two
bf16 values is exact in fp32, so an fp32 GEMM of the upcast inputs, rounded once, computes the same
result up to the order of the fp32 sums -- which differs between any two GEMM kernels. This module
registers such kernels for those four ops on torch's CPU dispatch key, for bf16 inputs only (other
dtypes run the ops' own ``out=`` kernels), once per process and only where the CPU lacks bf16
arithmetic: the run's bf16 semantics are unchanged, its GEMMs run at the fp32 rate.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from shardwise.runtime.machine import cpu_has_native_bf16

BF16 = torch.bfloat16
_LIBRARY: torch.library.Library | None = None


def _all_bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == BF16 for t in tensors)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _all_bf16(a, b):
        return torch.mm(a.float(), b.float()).to(BF16)
    return torch.mm(a, b, out=a.new_empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b)))


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1,
           alpha: Any = 1) -> torch.Tensor:
    if _all_bf16(c, a, b):
        return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(BF16)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b))
    return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=out)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _all_bf16(a, b):
        return torch.bmm(a.float(), b.float()).to(BF16)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.result_type(a, b))
    return torch.bmm(a, b, out=out)


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1,
             alpha: Any = 1) -> torch.Tensor:
    if _all_bf16(c, a, b):
        return torch.baddbmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(BF16)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.result_type(a, b))
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha, out=out)


KERNELS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm}
"""The ops whose CPU kernel :func:`use_fp32_gemms_for_bf16` replaces (each op's default overload)."""


def use_fp32_gemms_for_bf16(device_type: str, precision: str) -> bool:
    """On a CPU without bf16 arithmetic and a bf16 run, run bf16 GEMMs as fp32 GEMMs of their inputs
    rounded once (see the module docstring), for the rest of the process; returns whether they run
    so. Elsewhere (GPUs, CPUs with AMX or AVX512-BF16, fp32 runs) nothing changes."""
    if device_type != "cpu" or precision != "bf16" or cpu_has_native_bf16():
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
    if precision == "bf16" and not cpu_has_native_bf16():
        return registered()
    return contextlib.nullcontext()
