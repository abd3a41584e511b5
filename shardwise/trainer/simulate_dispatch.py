"""The per-rank loop of torch's ``LocalTensorMode``, made lean for hundreds of simulated ranks.

Torch's loop (``_for_each_rank_run_func``) runs each operation once per simulated rank. Around every
call it restores that rank's random-number state and saves it back after: two 5 KB generator copies
per rank per operation, needed only by the operations that draw random numbers. And every view
(a reshape, a slice, a transpose) reads its input's sizes, strides and storage offset to alias the
result's storage; a simulated tensor answers each of the three by entering a mode of its own, which
clones every rank's generator and re-patches torch's mesh and random functions. At 512 ranks these
copies are a large share of a step.

:func:`lean_dispatch` computes the same things without them:

- an operation that draws random numbers (torch tags it ``nondeterministic_seeded``), and any
  callable that is not an ATen operation, goes through torch's own loop unchanged;
- any other operation runs on each rank's tensors without touching the generators. It cannot change
  a generator, so every rank's saved state is the one torch's loop would have saved. The process's
  generator is left at the last rank's state, as torch's loop leaves it;
- a simulated tensor's sizes are its own (as the mode answers them), its strides and storage offset
  each rank's, combined as torch's loop combines them, without entering a mode.

``tests/unit/test_simulate.py`` trains the same simulated ranks with and without it and holds the
weights (initialized from the per-rank generators) and the generators bitwise equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _draws_random(func: Any) -> bool:  # noqa: ANN401 - an OpOverload or any callable
    return not isinstance(func, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in func.tags


@contextlib.contextmanager
def lean_dispatch() -> Iterator[None]:
    """Within: LocalTensorMode's per-rank loop skips the generator copies of operations that draw no
    random numbers (see the module's docstring)."""
    import torch.distributed._local_tensor as lt

    torchs = lt._for_each_rank_run_func
    own_dispatch = lt.LocalTensor.__dict__["__torch_dispatch__"]
    metadata = {torch.ops.aten.sym_stride.default, torch.ops.aten.sym_storage_offset.default}

    @torch._disable_dynamo
    def answer(cls: type, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None  # noqa: ANN401
               ) -> Any:  # noqa: ANN401 - the op's own result
        if func is torch.ops.aten.sym_size.default and not kwargs:
            return tuple(args[0]._size)
        if func in metadata and not kwargs:
            local = args[0]._local_tensors
            return lt._combine_rank_results({r: func(local[r]) for r in sorted(local)}, None)
        return own_dispatch.__func__(cls, func, types, args, kwargs)

    def each_rank(func: Any, ranks: frozenset[int], args: Sequence[Any], kwargs: dict[str, Any],  # noqa: ANN401
                  *, alias: bool = True) -> Any:  # noqa: ANN401 - the op's own result
        if _draws_random(func):
            return torchs(func, ranks, args, kwargs, alias=alias)
        return _run_each(lt, func, ranks, args, kwargs, alias)

    lt._for_each_rank_run_func = each_rank
    lt.LocalTensor.__torch_dispatch__ = classmethod(answer)
    try:
        yield
    finally:
        lt._for_each_rank_run_func = torchs
        lt.LocalTensor.__torch_dispatch__ = own_dispatch


def _run_each(lt: Any, func: Callable, ranks: frozenset[int], args: Sequence[Any],  # noqa: ANN401
              kwargs: dict[str, Any], alias: bool) -> Any:  # noqa: ANN401
    """Torch's loop body for an operation that draws no random numbers: each rank's arguments, the
    call, the results combined; an in-place operation returns its input, a view is aliased."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    flat = [a.wait() if isinstance(a, lt.AsyncCollectiveTensor) else a for a in flat]
    varying = [i for i, a in enumerate(flat) if isinstance(a, (lt.LocalTensor, torch.SymInt))]
    results: dict[int, Any] = {}
    default = None
    for r in sorted(ranks):
        mine = list(flat)
        for i in varying:
            mine[i] = lt._map_to_rank_local_val(flat[i], r)
        rank_args, rank_kwargs = pytree.tree_unflatten(mine, spec)
        if func is torch.ops.aten.hash_tensor.default and rank_args[0].numel() == 0:
            results[r] = torch.empty(0, dtype=torch.uint64, device=rank_args[0].device)
        else:
            results[r] = func(*rank_args, **rank_kwargs)
        if default is None and func is torch.ops.aten.split.Tensor:
            # (a split a rank cannot fill is padded with empty chunks, as torch's loop pads it)
            default = lt._zero_sized_like(mine[0], 0 if len(mine) < 3 else mine[2])
    if lt._is_inplace_op(func):
        ret = args[0]
        if torch.Tag.inplace_view in func.tags:
            ret._sync_meta()  # (the wrapper's sizes follow its tensors')
        return ret
    ret = lt._combine_rank_results(results, default)
    return lt.return_and_correct_aliasing(func, args, kwargs, ret) if alias else ret
