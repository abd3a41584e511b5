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
  each rank's, combined as torch's loop combines them, without entering a mode;
- where every per-rank argument is a top-level positional one, each rank's call substitutes those
  alone instead of rebuilding the whole argument tree, and a new simulated tensor whose ranks'
  tensors share sizes, strides and dtype takes its metadata from the first (torch compares each
  dimension of each rank; any difference still goes to torch's own).

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

    torchs_meta = lt._compute_local_tensor_meta

    def meta(local_tensors: dict[int, torch.Tensor]) -> tuple:
        # every rank's tensor alike (the common case): the first's sizes and strides, as torch's
        # per-dimension, per-rank comparison finds them; any difference goes to torch's own
        it = iter(local_tensors.values())
        first = next(it)
        shape, stride, dtype, layout = first.shape, first.stride(), first.dtype, first.layout
        conj, neg = first.is_conj(), first.is_neg()
        for t in it:
            if (t.shape != shape or t.stride() != stride or t.dtype != dtype or t.layout != layout
                    or t.is_conj() != conj or t.is_neg() != neg):
                return torchs_meta(local_tensors)
        return list(shape), list(stride), first.device, dtype, layout, lt._get_extra_dispatch_keys(first)

    lt._for_each_rank_run_func = each_rank
    lt.LocalTensor.__torch_dispatch__ = classmethod(answer)
    lt._compute_local_tensor_meta = meta
    try:
        yield
    finally:
        lt._for_each_rank_run_func = torchs
        lt.LocalTensor.__torch_dispatch__ = own_dispatch
        lt._compute_local_tensor_meta = torchs_meta


def _run_each(lt: Any, func: Callable, ranks: frozenset[int], args: Sequence[Any],  # noqa: ANN401
              kwargs: dict[str, Any], alias: bool) -> Any:  # noqa: ANN401
    """Torch's loop body for an operation that draws no random numbers: each rank's arguments, the
    call, the results combined; an in-place operation returns its input, a view is aliased. Where
    every per-rank argument is a top-level positional one (most operations), each rank's call
    substitutes those alone instead of rebuilding the whole argument tree."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    varying = [i for i, a in enumerate(flat) if isinstance(a, (lt.LocalTensor, torch.SymInt))]
    top = [i for i, a in enumerate(args) if isinstance(a, (lt.LocalTensor, torch.SymInt))]
    waits = any(isinstance(a, lt.AsyncCollectiveTensor) for a in flat)
    if func is torch.ops.aten.hash_tensor.default or waits or len(top) != len(varying):
        rank_call = _tree_call(lt, func, flat, spec)
    else:
        def rank_call(r: int) -> Any:  # noqa: ANN401
            mine = list(args)
            for i in top:
                mine[i] = lt._map_to_rank_local_val(args[i], r)
            return func(*mine, **kwargs)
    results = {r: rank_call(r) for r in sorted(ranks)}
    default = None
    if func is torch.ops.aten.split.Tensor:
        # (a split a rank cannot fill is padded with empty chunks, as torch's loop pads it)
        first = lt._map_to_rank_local_val(args[0], min(ranks))
        default = lt._zero_sized_like(first, args[2] if len(args) > 2 else kwargs.get("dim", 0))
    if lt._is_inplace_op(func):
        ret = args[0]
        if torch.Tag.inplace_view in func.tags:
            ret._sync_meta()  # (the wrapper's sizes follow its tensors')
        return ret
    ret = lt._combine_rank_results(results, default)
    return lt.return_and_correct_aliasing(func, args, kwargs, ret) if alias else ret


def _tree_call(lt: Any, func: Callable, flat: list, spec: Any) -> Callable[[int], Any]:  # noqa: ANN401
    """Each rank's call with its values put back into the whole argument tree (torch's way); a
    collective's result still in flight is waited for first, and is then per-rank like any other."""
    flat = [a.wait() if isinstance(a, lt.AsyncCollectiveTensor) else a for a in flat]
    varying = [i for i, a in enumerate(flat) if isinstance(a, (lt.LocalTensor, torch.SymInt))]

    def rank_call(r: int) -> Any:  # noqa: ANN401
        mine = list(flat)
        for i in varying:
            mine[i] = lt._map_to_rank_local_val(flat[i], r)
        rank_args, rank_kwargs = pytree.tree_unflatten(mine, spec)
        if func is torch.ops.aten.hash_tensor.default and rank_args[0].numel() == 0:
            return torch.empty(0, dtype=torch.uint64, device=rank_args[0].device)
        return func(*rank_args, **rank_kwargs)
    return rank_call
