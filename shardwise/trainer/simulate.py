"""Many ranks in one process: torch's ``LocalTensorMode`` (``torch.distributed._local_tensor``, a
private module whose behaviour tests/unit/test_simulate.py pins) runs every rank's tensors side by
side, its collectives computed over all of them at once. The trainer, the parallelize functions and
the optimizer run as they are; this module holds the smallest adapters that make torch's pieces
compute on simulated ranks what they compute on real ones.

- FSDP2 frees and re-allocates each unsharded parameter's storage (``resize_``): a simulated
  tensor's storage is each rank's own (:func:`_per_rank_storage`).
- FSDP2 cuts each rank's shard by its process group's ``rank()``, which in one process is rank 0's:
  every simulated rank would hold rank 0's chunk shape. After materialization :func:`refill_shards`
  gives each rank the view of its own chunk (uneven chunks differ by rank).
- LocalTensorMode finds each rank's coordinates on a mesh by remapping the whole mesh once per rank,
  for every mesh object DTensor and FSDP make (one per parameter): at 64 ranks, most of the
  build's time. :func:`_coordinates_once` remaps it once, and caches by the mesh's layout.
- Document-masked attention splits each rank's batch by where its documents lie, a host-side
  structure that differs by rank: :class:`RankDocuments` runs each rank's attention on its own
  tensors (forward and backward), through the model's ``document_spans`` hook.

- Torch's per-rank loop copies every rank's random generator around every operation, and a view's
  reads of its input's strides enter a mode that copies them again:
  :func:`~shardwise.trainer.simulate_dispatch.lean_dispatch` skips the copies where no random
  number is drawn (the same results, bitwise; 1.5x faster steps).
- Pipeline ranks run different programs: :func:`on_ranks` runs each pipeline rank's slice of
  simulated ranks in a thread of its own (:mod:`shardwise.trainer.simulate_stages`).

:func:`simulated_ranks` installs the first, third and fifth; :func:`adapt` applies the second and fourth
to a materialized model (outside a simulation it does nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config.schema import ConfigError
from shardwise.models.layers import DocumentSpans, attention_by_document
from shardwise.models.moe import GroupedExperts, swiglu_groups
from shardwise.trainer.simulate_dispatch import lean_dispatch
from shardwise.trainer.simulate_stages import Stages, across_stages

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

T = TypeVar("T")


def simulating() -> bool:
    """Whether a :func:`simulated_world` is active (cheap: called once per materialization)."""
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode() is not None


@contextlib.contextmanager
def simulated_world(world: int) -> Iterator[None]:
    """``world`` ranks simulated in this process (:func:`simulated_ranks`), all of them computed
    side by side in one ``LocalTensorMode``."""
    from torch.distributed._local_tensor import LocalTensorMode

    with simulated_ranks(world), LocalTensorMode(frozenset(range(world))):
        yield


@contextlib.contextmanager
def simulated_ranks(world: int) -> Iterator[None]:
    """A process of ``world`` simulated ranks: torch's ``fake`` process group (rank 0 of ``world``)
    with the FSDP2 and mesh adapters; which ranks compute is :func:`on_ranks`'s (or a
    ``LocalTensorMode``'s). Torch's state (process group, DTensor's RNG tracker, FSDP's storage
    functions) is restored after."""
    from torch.distributed.tensor import _random
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("simulated ranks need a process without a process group: run "
                          "`shardwise verify --ranks` on its own, not inside training")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    _forget_meshes()
    try:
        with _per_rank_storage(), _coordinates_once(), lean_dispatch():
            yield
    finally:
        dist.destroy_process_group()
        _random._rng_tracker = None  # the simulation's tracker holds every rank's generator
        _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's sharding caches. They key on a spec's mesh, which compares equal to a mesh of
    the same layout from an earlier world: a later simulated world of the same shape was handed the
    old mesh, whose process groups were gone ("Could not resolve the process group")."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def stage_slices(pp_mesh: dist.DeviceMesh) -> list[frozenset[int]]:
    """The ranks at each index of the ``pp`` mesh (one pipeline rank's every replica and shard)."""
    grid = pp_mesh._layout.remap_to_tensor(pp_mesh._rank_map)  # (pp groups, pp)
    return [frozenset(grid[:, i].tolist()) for i in range(grid.shape[1])]


def on_ranks(slices: list[frozenset[int]], fn: Callable[[], T]) -> list[T]:
    """``fn()`` on each slice of simulated ranks: one slice in this thread, under a
    ``LocalTensorMode`` over it; several (pipeline ranks, which run different code: MPMD) each in a
    thread of torch's ``LocalRunnerMode``, one thread running at a time, handing over where one
    waits for another (:mod:`shardwise.trainer.simulate_stages`)."""
    from torch.distributed._local_tensor import LocalTensorMode

    if len(slices) == 1:
        with LocalTensorMode(slices[0]):
            return [fn()]
    stages = Stages(slices, fn)
    threads = torch.get_num_threads()
    try:
        with across_stages(stages), stages:
            pass
    finally:
        torch.set_num_threads(threads)  # (each stage thread computes on one)
    if stages.failed is not None:
        raise stages.failed
    return stages.results


@contextlib.contextmanager
def _per_rank_storage() -> Iterator[None]:
    """FSDP2's storage free/alloc applied to each simulated rank's tensor."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def each(fn):  # noqa: ANN001, ANN202 - FSDP's own (tensor) -> None functions
        def apply(t: torch.Tensor) -> None:
            for local in (t._local_tensors.values() if isinstance(t, LocalTensor) else [t]):
                fn(local)
        return apply

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = each(alloc), each(free)
    _fsdp_param_group.alloc_storage = _fsdp_param.alloc_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
        _fsdp_param_group.alloc_storage = alloc


@contextlib.contextmanager
def _coordinates_once() -> Iterator[None]:
    """LocalTensorMode's ``DeviceMesh.get_coordinate`` (every rank's coordinates, as one SymInt per
    mesh dim), computed from one remap of the mesh, outside the mode, and cached by the mesh's layout
    and ranks rather than by the object."""
    from torch.distributed._local_tensor import (
        LocalIntNode,
        _LocalDeviceMesh,
        enabled_local_tensor_mode,
        maybe_disable_local_tensor_mode,
    )

    cache: dict[tuple, list] = {}
    original = _LocalDeviceMesh.__dict__["get_coordinate"]

    def get_coordinate(self: dist.DeviceMesh) -> list[torch.SymInt]:
        ranks = enabled_local_tensor_mode().ranks
        key = (self._layout, self._flatten_rank_map, ranks)
        if key not in cache:
            with maybe_disable_local_tensor_mode():
                grid = self._layout.remap_to_tensor(self._rank_map)  # (groups, *mesh shape)
                flat = grid.reshape(grid.shape[0], -1).tolist()
            coords: list[dict[int, int]] = [{} for _ in range(self.ndim)]
            shape = list(grid.shape[1:])
            for group in flat:
                for i, r in enumerate(group):
                    if r in ranks:
                        for d in reversed(range(self.ndim)):  # (the flat index, unravelled)
                            coords[d][r], i = i % shape[d], i // shape[d]
            if any(len(c) != len(ranks) for c in coords):
                raise AssertionError(f"a simulated rank is missing from mesh {self}")
            # (a coordinate every simulated rank shares is a plain int, as on a real rank: a
            # pipeline rank's own pp index, which torch's stage arithmetic takes as an int)
            cache[key] = [next(iter(c.values())) if len(set(c.values())) == 1
                          else torch.SymInt(LocalIntNode(c)) for c in coords]
        return cache[key]

    _LocalDeviceMesh.get_coordinate = staticmethod(get_coordinate)
    try:
        yield
    finally:
        _LocalDeviceMesh.get_coordinate = original


def coordinates(mesh: dist.DeviceMesh, dim: int | str = 0) -> dict[int, int]:
    """{simulated rank: its index along ``mesh``'s dim ``dim``} (the mesh of that rank's group)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    index = mesh.get_local_rank(dim)  # patched by LocalTensorMode: every rank's, as one SymInt
    if isinstance(index, int):
        return dict.fromkeys(enabled_local_tensor_mode().ranks, index)
    node = index.node
    return dict(node._local_ints) if hasattr(node, "_local_ints") else dict.fromkeys(
        enabled_local_tensor_mode().ranks, int(node.val))


def adapt(model: nn.Module) -> None:
    """After ``to_empty`` on simulated ranks: :func:`refill_shards`, and document masks through
    :class:`RankDocuments` (context parallel brings its own); a no-op unless simulating."""
    if not simulating():
        return
    refill_shards(model)
    if getattr(model, "document_spans", None) is DocumentSpans.of:
        model.document_spans = RankDocuments.of
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.groups = _experts_each_rank


def refill_shards(model: nn.Module) -> None:
    """Each simulated rank's FSDP2 shard becomes the view of its own chunk of the padded shard
    storage (its length along the shard dim by the rank's coordinate)."""
    from torch.distributed.fsdp import FSDPModule

    # (several pipeline stages on a rank: their views, not submodules of the part, are FSDP's roots
    # of the embedding and the head: parallel/fsdp.py)
    roots = [model, *getattr(model, "stage_views", [])]
    groups = {id(g): g for root in roots for m in root.modules() if isinstance(m, FSDPModule)
              if (g := m._get_fsdp_state()._fsdp_param_group) is not None}
    for group in groups.values():
        for fp in group.fsdp_params:
            _refill(fp)


def _refill(fp: FSDPParam) -> None:
    """One FSDPParam: FSDP's own reset re-reads the materialized shard (every rank's of rank 0's
    padded shape), then each rank's view is cut to its own chunk. FSDP's lazy init resets again;
    its checks compare sizes that now differ by rank, so the reset is this one from then on."""
    from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
    from torch.distributed.fsdp._fully_shard._fsdp_param import make_contiguous_strides_for

    current = getattr(fp, "_simulated_shard", None)
    if current is not None and fp.sharded_param._local_tensor is current:
        return  # unchanged since the cut (FSDP's lazy init)
    type(fp).reset_sharded_param(fp)  # (the class's: the instance's is this function from now on)
    info, dim = fp.mesh_info, fp.fsdp_placement.dim
    full, n = fp._orig_size[dim], info.shard_mesh_size
    step = -(-full // n)  # torch.chunk's: every chunk but the last is full
    where = coordinates(info.mesh, info.shard_mesh_dim)
    with maybe_disable_local_tensor_mode():
        shards = {r: t.view(fp.padded_sharded_param_size).narrow(dim, 0, _chunk(full, step, where[r]))
                  for r, t in fp._sharded_param_data._local_tensors.items()}
    local = LocalTensor(shards)
    fp.sharded_param._local_tensor = fp._simulated_shard = local
    fp.sharded_size = local.size()  # per-rank lengths (FSDP cuts each reduced gradient to it)
    fp.contiguous_sharded_stride = make_contiguous_strides_for(fp.sharded_size)
    fp.reset_sharded_param = lambda: _refill(fp)


def _chunk(full: int, step: int, index: int) -> int:
    """The length of chunk ``index`` when ``full`` rows are cut in chunks of ``step`` (0 past the end)."""
    return max(0, min(step, full - index * step))


def from_ranks(values: dict[int, torch.Tensor]) -> torch.Tensor:
    """One simulated tensor holding ``values[r]`` on rank r (plain tensors: one made under the mode
    -- ``torch.arange`` there -- is itself every rank's, and nested it computes garbage)."""
    from torch.distributed._local_tensor import LocalTensor

    if any(isinstance(v, LocalTensor) for v in values.values()):
        raise AssertionError("from_ranks takes each rank's plain tensor: make them under simulate.plain()")
    return LocalTensor(values)


def every_rank_tensor(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """A simulated tensor's value on each rank (a DTensor's local shard there); a plain tensor is
    every rank's."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode

    if hasattr(t, "to_local"):
        t = t.to_local()
    if isinstance(t, AsyncCollectiveTensor):  # (a collective's result still in flight)
        t = t.wait()
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return dict.fromkeys(enabled_local_tensor_mode().ranks, t)


def every_rank(t: torch.Tensor) -> dict[int, float]:
    """A simulated scalar's value on each rank."""
    return {r: float(v) for r, v in every_rank_tensor(t).items()}


class RankDocuments:
    """Every simulated rank's :class:`DocumentSpans`; ``attention`` (the duck-typed mask
    ``AttentionCore`` calls) runs each rank's document-masked attention on its own q, k, v."""

    def __init__(self, spans: dict[int, DocumentSpans]) -> None:
        self.spans = spans

    @classmethod
    def of(cls, doc_ids: torch.Tensor) -> RankDocuments:
        ids = every_rank_tensor(doc_ids)  # (a plain tensor: the same batch on every rank)
        with plain():
            return cls({r: DocumentSpans.of(t) for r, t in ids.items()})

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
                  ) -> torch.Tensor:
        return each_rank(lambda r, *qkv: attention_by_document(*qkv, self.spans[r], scale), q, k, v)


def _experts_each_rank(*tensors: torch.Tensor) -> torch.Tensor:
    """Each rank's expert groups (their sizes its routing's) on its own tokens and weights."""
    return each_rank(lambda r, *own: swiglu_groups(*own), *tensors)


def each_rank(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(rank, *plain tensors)`` on each simulated rank's own values of ``tensors``, as one
    simulated tensor, with autograd through every rank's graph: for computations whose shapes or
    host-side steps depend on the rank's data (document spans, expert group sizes), which a
    simulated tensor's one program cannot take."""
    return _EachRank.apply(fn, *tensors)


class _EachRank(torch.autograd.Function):
    """:func:`each_rank`: each rank's graph kept for the backward (the memory a real rank's keeps)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode

        ranks = next((sorted(t._local_tensors) for t in tensors if isinstance(t, LocalTensor)), None)
        if ranks is None:
            raise AssertionError("each_rank needs a simulated tensor among its inputs")
        ctx.graphs, outs = {}, {}
        with maybe_disable_local_tensor_mode(), torch.enable_grad():
            for r in ranks:
                ins = tuple(_rank_value(t, r).detach().requires_grad_(t.requires_grad) for t in tensors)
                out = fn(r, *ins)
                ctx.graphs[r] = (ins, out)
                outs[r] = out.detach()
        return LocalTensor(outs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001 - ctx
        from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode

        n = len(next(iter(ctx.graphs.values()))[0])
        grads: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]
        with maybe_disable_local_tensor_mode():
            for r, (ins, out) in ctx.graphs.items():
                wanted = [t for t in ins if t.requires_grad]
                got = iter(torch.autograd.grad(out, wanted, _rank_value(grad, r)) if wanted else ())
                for i, t in enumerate(ins):
                    grads[i][r] = next(got) if t.requires_grad else None
        ctx.graphs = None
        return None, *(LocalTensor(g) if all(v is not None for v in g.values()) else None for g in grads)


def _rank_value(t: torch.Tensor, rank: int) -> torch.Tensor:
    """``t``'s value on ``rank`` (a plain tensor is every rank's)."""
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[rank] if isinstance(t, LocalTensor) else t


def plain() -> contextlib.AbstractContextManager:
    """Within: operations on plain tensors run as plain ones (LocalTensorMode suspended)."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()
