"""What each rank holds between steps -- parameters, gradients, optimizer states -- and the FSDP
units it gathers and reduces, for any layout and world size, without the cluster.

Two ways, tested equal (tests/unit/test_plan_states.py):

- :func:`built_states` builds the real model on the meta device and parallelizes it with the
  trainer's own ``parallelize()`` over torch's ``fake`` process-group backend (one process stands
  in for every rank: collectives are no-ops, meshes and DTensor shardings are real). The local
  shard shapes and FSDP's parameter groups are then read off the modules, so what is counted is
  what ``shardwise train`` would allocate. ``shardwise estimate`` uses it.
- :func:`shape_states` applies the same sharding rules to the parameter shapes (tensor parallel's
  plan, expert parallel, FSDP's dim-0 chunks with padding): milliseconds per layout, which is what
  lets ``shardwise plan`` cost thousands of layouts.

Byte counts are of the local shards, as :func:`shardwise.observe.memory.state_bytes` measures them
during training. Ranks differ (uneven chunks, pipeline stages holding the embedding or the head):
each pipeline rank is reported at data/tensor coordinate 0, which holds the largest chunk.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise.runtime.machine
from shardwise.config.schema import Config, ConfigError
from shardwise.models import ModelArgs
from shardwise.models.transformer import build_model
from shardwise.parallel.dims import Degrees, Mesh
from shardwise.parallel.fsdp import one_unit, plain_rank
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.stages import rank_stages, stage_layers
from shardwise.resolve.run import ResolvedRun
from shardwise.runtime.distributed import init_process_group
from shardwise.trainer.build import build_stage

BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` parameter group: gathered and reduced as one collective."""

    name: str
    numel: int
    """Unsharded elements, padded to a multiple of ``shard`` along dim 0 (the all-gather output)."""
    shard: int
    """Ranks the parameters are sharded over."""
    group: str
    """Mesh dim of the shard group: dp_shard_cp (blocks, root), moe (router and shared expert of
    an MoE block: dp_shard x cp x tp) or efsdp (experts under expert parallel)."""
    replicate: int
    """HSDP replicas: the sharded gradient is all-reduced over dp_replicate."""
    reshard: bool
    """Freed after forward and gathered again for backward."""
    layer: int | None
    """The block it belongs to; None for the root (embedding, final norm, output head)."""
    blocks: tuple[tuple[int, int], ...] = ()
    """The root of a one-unit model (parallel/fsdp.py one_unit): (layer, unsharded elements) of each
    block it holds, whose gradients appear during that block's backward."""


@dataclass(frozen=True)
class RankStates:
    pp_rank: int
    params: int
    """Bytes of fp32 parameter shards."""
    grads: int
    optimizer: int
    units: tuple[FsdpUnit, ...]
    layers: tuple[int, ...]
    """Blocks this rank runs, in order."""
    has_embedding: bool
    has_head: bool
    plain: tuple[tuple[int | None, int], ...] = ()
    """A model without FSDP (``parallel.one_rank``): (block, elements) of each block in order, then
    (None, elements) of the rest (embedding, final norm, head); their fp32 gradients appear in that
    part's backward and stay. Empty under FSDP."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def optimizer_bytes_per_element(cfg: Config) -> int:
    """AdamW's two moments (exp_avg, exp_avg_sq) per parameter element."""
    return 2 * BYTES[cfg.optimizer.state_dtype]


# ---------------------------------------------------------------------------------------------
# Exact: the real model on the fake backend


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """torch's ``fake`` process group of ``world`` ranks, as ``rank``: meshes and DTensors are real,
    collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("the estimator builds the model on its own fake process group: run it in a "
                          "process without one (shardwise estimate, not inside training)")
    init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank(run: ResolvedRun, every_block: bool = False) -> tuple[nn.Module, object]:
    """The calling rank's model (its pipeline stages), parallelized on meta as the trainer does it;
    call inside :func:`fake_world`. Returns (model, ParallelDims). Blocks that parallelize alike
    (:func:`_drop_alike_blocks`) are built once unless ``every_block``; the model's ``alike``
    attribute maps each dropped block to the one kept for it."""
    # The mesh is this fake world's: built on a copy of the degrees, so ``run`` keeps none.
    run = dataclasses.replace(run, dims=copy.copy(run.dims))
    # The fake world's mesh is on the CPU; FSDP's units are the planned device's (one_unit).
    run.dims.build_mesh("cpu", target_device=planned_device(run))
    model = build_stage(run)
    model.alike = {} if every_block else _drop_alike_blocks(model)
    with warnings.catch_warnings():
        # A pipeline stage without the head has no 'output' for the TP plan to resolve.
        warnings.filterwarnings("ignore", message="Parallelize plan key")
        parallelize(model, run.dims, run.cfg, run.compile)
    return model, run.dims


def _drop_alike_blocks(model: nn.Module) -> dict[int, int]:
    """Remove from ``model`` (before parallelize) each block that another kept block stands for:
    same modules and parameter shapes, and neither is the rank's last block (which FSDP keeps
    gathered after forward). Every parallelism treats such blocks alike, wherever their stage, so
    their shards and FSDP units are the same but for the name. Returns {dropped layer: kept layer}."""
    views = getattr(model, "stage_views", None) or []
    last = list(model.layers)[-1]
    kept: dict[tuple, int] = {}
    alike: dict[int, int] = {}
    for key, block in list(model.layers.items()):
        sig = (key == last, tuple(type(m).__name__ for m in block.modules()),
               tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))
        if sig in kept:
            alike[int(key)] = kept[sig]
            del model.layers[key]
            for v in views:
                if key in v.layers:
                    del v.layers[key]
        else:
            kept[sig] = int(key)
    return alike


def built_states(run: ResolvedRun, every_block: bool = False) -> list[RankStates]:
    """Per pipeline rank, the states and FSDP units of the real parallelized model.

    What parallelizes alike is built once and counted for each (``every_block``: build every
    block of every rank; a test holds the two equal): blocks of one kind within a rank
    (:func:`_drop_alike_blocks`), and pipeline ranks whose stages hold the same kinds of blocks
    and the same ends of the model. Sharding a 405B rank's 126 blocks on meta takes 3 s here."""
    pipe, args, world = run.pipeline, run.model, run.world
    n_stages = pipe.pp * pipe.stages_per_rank
    per_stage = stage_layers(args.n_layers, n_stages)
    out: list[RankStates] = []
    built: dict[tuple, RankStates] = {}
    for s in range(pipe.pp):
        stages = rank_stages(s, pipe.pp, pipe.schedule, pipe.interleaved) if pipe.pp > 1 else [0]
        sig = (0 in stages, n_stages - 1 in stages,
               tuple(tuple(args.is_moe_layer(i) for i in per_stage[st]) for st in stages))
        if not every_block and sig in built:
            layers = sorted(i for st in stages for i in per_stage[st])
            out.append(_relabel(built[sig], s, layers))
            continue
        rank = s * (world // pipe.pp)  # pipeline coordinate s, every other coordinate 0
        with fake_world(world, rank):
            model, _ = build_rank(run, every_block)
            built[sig] = _read_states(model, run.cfg, s)
        out.append(built[sig])
    return out


def _relabel(states: RankStates, pp_rank: int, layers: list[int]) -> RankStates:
    """``states`` of another pipeline rank, its blocks renamed in order to ``layers``."""
    new = dict(zip(states.layers, layers, strict=True))

    def unit(u: FsdpUnit) -> FsdpUnit:
        if u.layer is None:
            return dataclasses.replace(u, blocks=tuple((new[i], n) for i, n in u.blocks))
        return _moved(u, new[u.layer])
    return dataclasses.replace(states, pp_rank=pp_rank, layers=tuple(layers),
                               units=tuple(unit(u) for u in states.units))


def _moved(u: FsdpUnit, layer: int) -> FsdpUnit:
    """Block unit ``u`` as the same unit of block ``layer`` (``layers.3.feed_forward`` ->
    ``layers.7.feed_forward``)."""
    return dataclasses.replace(u, name=f"layers.{layer}" + u.name[len(f"layers.{u.layer}"):], layer=layer)


def _local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _read_states(model: nn.Module, cfg: Config, pp_rank: int) -> RankStates:
    """The states and FSDP units read off ``model``, each dropped alike block (``model.alike``)
    counted as the block kept for it, in the order a build of every block gives."""
    from torch.distributed.fsdp import FSDPModule

    alike: dict[int, int] = getattr(model, "alike", {})
    block_numel = {int(k): sum(_local_numel(p) for p in b.parameters()) for k, b in model.layers.items()}
    numel = sum(_local_numel(p) for p in model.parameters()) + sum(block_numel[r] for r in alike.values())
    layers = sorted([*block_numel, *alike])
    rep = {i: alike.get(i, i) for i in layers}
    before, per_layer, after = [], {}, []
    views = getattr(model, "stage_views", None) or []
    for name, m in [*model.named_modules(), *((f"(stage {i})", v) for i, v in enumerate(views))]:
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        info = group.mesh_info
        shard = info.shard_mesh_size
        padded = sum(fp.padded_sharded_param_size.numel() for fp in group.fsdp_params) * shard
        mesh_name = info.mesh.mesh_dim_names[-1] if info.mesh.mesh_dim_names else ""
        kind = {Mesh.EFSDP: Mesh.EFSDP, Mesh.DP_SHARD_CP_TP: Mesh.MOE}.get(mesh_name, Mesh.DP_SHARD_CP)
        parts = name.split(".")
        layer = int(parts[1]) if len(parts) > 1 and parts[0] == "layers" else None
        blocks: tuple[tuple[int, int], ...] = ()
        if layer is None:  # a root holding blocks (one unit) holds the dropped alike ones too
            held = {id(fp.sharded_param) for fp in group.fsdp_params}
            n = {int(k): s for k, block in model.layers.items()
                 if (s := sum(_local_numel(p) for p in block.parameters() if id(p) in held))}
            blocks = tuple((i, n[rep[i]]) for i in layers if rep[i] in n)
            padded += sum(s for i, s in blocks if i in alike)  # one unit: one rank, nothing padded
        u = FsdpUnit(name if layer is not None else "(root)", padded, shard, kind,
                     getattr(info, "replicate_mesh_size", 1), group.post_forward_mesh_info is not None,
                     layer, blocks)
        if layer is not None:
            per_layer.setdefault(layer, []).append(u)
        else:
            (after if per_layer else before).append(u)
    units = [*before]
    for i in layers:
        units += [_moved(u, i) for u in per_layer.get(rep[i], [])]
    plain: list[tuple[int | None, int]] = []
    if not any(isinstance(m, FSDPModule) for m in [*model.modules(), *views]):
        plain = [(i, block_numel[rep[i]]) for i in layers]
        plain.append((None, numel - sum(n for _, n in plain)))
    return RankStates(pp_rank, 4 * numel, 4 * numel, optimizer_bytes_per_element(cfg) * numel,
                      tuple(units + after), tuple(layers), getattr(model, model.plan.embedding) is not None,
                      getattr(model, model.plan.norm, None) is not None, tuple(plain))


# ---------------------------------------------------------------------------------------------
# Fast: the same rules on shapes

def _chunk(n: int, k: int, index: int = 0) -> int:
    """Chunk ``index``'s share of ``n`` split in ``k`` chunks the way torch.chunk does: every chunk
    ``ceil(n / k)`` long but the last ones (rank 0's, the default, is the largest)."""
    step = -(-n // k)
    return max(0, min(step, n - index * step))


@dataclass(frozen=True)
class Coordinates:
    """A rank's index along each mesh dim that cuts its shards; the planner's figures are the
    default's, all 0, which holds the largest chunk of every parameter."""

    tp: int = 0
    fsdp: int = 0
    """In the shard group of blocks and the root (dp_shard x cp)."""
    ep: int = 0
    moe: int = 0
    """In an MoE block's router and shared-expert shard group (dp_shard x cp x tp)."""
    efsdp: int = 0
    """In the experts' shard group under expert parallel."""


@dataclass(frozen=True)
class ParamShapes:
    """Parameter (name, shape) of one block of each kind (``dense``, ``moe_block``) and of the root
    modules (``embedding``, ``head``), with what the model's plans say of them: the dim tensor
    parallel splits (block-relative names for block parameters) and the routed feed-forward and
    experts of an MoE block."""

    kinds: dict[str, list[tuple[str, tuple[int, ...]]]]
    tp_dims: dict[str, int]
    routed: str = ""
    experts: str = ""

    def __getitem__(self, kind: str) -> list[tuple[str, tuple[int, ...]]]:
        return self.kinds[kind]


def param_shapes(args: ModelArgs) -> ParamShapes:
    """The parameters of one block of each kind and of the root modules, and their plans, from the
    model itself on meta (a one-block model per kind, so nothing is duplicated here)."""
    kinds: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    dense = build_model(dataclasses.replace(args, n_layers=1, n_experts=0))
    models = {"dense": dense}
    if args.n_experts:
        models["moe_block"] = build_model(dataclasses.replace(args, n_layers=1, n_dense_layers=0))
    ends = dense.plan
    # Column-parallel linears and the vocab-parallel embedding / head split dim 0, row-parallel
    # linears dim 1; norms are replicated, and a region that is not split (an MoE feed-forward) too.
    tp_dims = {f"{ends.embedding}.weight": 0, f"{ends.head}.weight": 0}
    for kind, model in models.items():
        block = model.layers["0"]
        kinds[kind] = [(n, tuple(p.shape)) for n, p in block.named_parameters()]  # (block-relative)
        for g in (g for g in block.plan.groups if g.split):
            tp_dims.update({f"{g.region}.{n}.weight": 0 for n in g.columns})
            tp_dims.update({f"{g.region}.{n}.weight": 1 for n in g.rows})
    def of(name: str) -> list[tuple[str, tuple[int, ...]]]:  # a root module's, by full name
        module = getattr(dense, name)
        return [(n, tuple(p.shape)) for n, p in module.named_parameters(prefix=name)] if module else []

    kinds["embedding"], kinds["head"] = of(ends.embedding), of(ends.norm) + of(ends.head)
    moe = models.get("moe_block")
    return ParamShapes(kinds, tp_dims, moe.layers["0"].plan.routed if moe else "",
                       moe.layers["0"].plan.experts if moe else "")


def _local_shape(name: str, shape: tuple[int, ...], degrees: Degrees, shapes: ParamShapes,
                 moe_ffn: bool, at: Coordinates = Coordinates()) -> tuple[int, ...]:
    """Shape after tensor and expert parallel (the chunk of the rank ``at``), before FSDP."""
    shape = list(shape)
    if moe_ffn:
        if name.startswith(shapes.experts + ".") and degrees.ep > 1:
            shape[0] = _chunk(shape[0], degrees.ep, at.ep)
    elif degrees.tp > 1 and (d := shapes.tp_dims.get(name)) is not None:
        shape[d] = _chunk(shape[d], degrees.tp, at.tp)
    return tuple(shape)


def _shard_numel(params: list[tuple[str, tuple[int, ...]]], degrees: Degrees, shapes: ParamShapes,
                 shard: int, moe_ffn: bool, at: Coordinates = Coordinates(), index: int = 0
                 ) -> tuple[int, int]:
    """(the local elements of the rank ``at``, at ``index`` in the shard group; padded unsharded
    elements) of parameters FSDP shards together."""
    local = padded = 0
    for name, shape in params:
        dims = _local_shape(name, shape, degrees, shapes, moe_ffn, at)
        rest = math.prod(dims[1:])
        local += _chunk(dims[0], shard, index) * rest
        padded += _chunk(dims[0], shard) * shard * rest
    return local, padded


def planned_device(run: ResolvedRun) -> str:
    """The device type the plan is for: run.device, or with ``auto`` this machine's (so a one-rank
    layout planned on a CPU machine gets the CPU's FSDP units; --run.device cuda plans a GPU's)."""
    device = run.device_type  # (the planner resolves runs without detecting the device)
    return device if device != "auto" else shardwise.runtime.machine.device_type("auto")


def shape_states(run: ResolvedRun, shapes: ParamShapes | None = None,
                 pp_ranks: list[int] | None = None, at: Coordinates = Coordinates()) -> list[RankStates]:
    """Per pipeline rank (``pp_ranks``, default all), the states and FSDP units
    :func:`built_states` would find, from shapes, of the rank at ``at`` along the other dims (default:
    the largest). ``shapes``: :func:`param_shapes` of the model, when the caller costs many layouts."""
    pipe, args = run.pipeline, run.model
    shapes = shapes or param_shapes(args)
    n_stages = pipe.pp * pipe.stages_per_rank
    per_stage = stage_layers(args.n_layers, n_stages)
    out = []
    for s in (range(pipe.pp) if pp_ranks is None else pp_ranks):
        stages = rank_stages(s, pipe.pp, pipe.schedule, pipe.interleaved) if pipe.pp > 1 else [0]
        layers = sorted(i for st in stages for i in per_stage[st])
        out.append(_rank_states(run, shapes, s, layers, 0 in stages, n_stages - 1 in stages, at))
    return out


def bounding_pp_ranks(run: ResolvedRun) -> list[int]:
    """Pipeline ranks whose states and step bound every rank's: for each distinct set of blocks a
    rank can hold (by kind: dense or MoE), the first rank holding it -- earlier ranks keep more
    micro-batches in flight -- and the last rank, which holds the head. Two for a model of alike
    blocks split evenly; more where kinds differ (DeepSeek-V3's dense first blocks)."""
    pipe, args = run.pipeline, run.model
    n_stages = pipe.pp * pipe.stages_per_rank
    per_stage = stage_layers(args.n_layers, n_stages)
    seen, out = set(), []
    for r in range(pipe.pp):
        stages = rank_stages(r, pipe.pp, pipe.schedule, pipe.interleaved) if pipe.pp > 1 else [0]
        kinds = tuple(sorted(args.is_moe_layer(i) for st in stages for i in per_stage[st]))
        if kinds not in seen:
            seen.add(kinds)
            out.append(r)
    return sorted({*out, pipe.pp - 1})


def _rank_states(run: ResolvedRun, shapes: ParamShapes, pp_rank: int, layers: list[int], has_emb: bool,
                 has_head: bool, at: Coordinates = Coordinates()) -> RankStates:
    """One pipeline rank: FSDP units in the order ``apply_fsdp`` makes them (per block: experts,
    MoE feed-forward, block; then the root or each stage view's root)."""
    d, args = run.dims.degrees, run.model
    moe_shard, fsdp = d.moe_shard, d.dp_shard * d.cp
    mode = run.cfg.parallel.reshard_after_forward
    single = one_unit(fsdp * d.dp_replicate, d.pp, planned_device(run))
    unwrapped = plain_rank(run.world, planned_device(run), run.cfg.parallel.one_rank)
    numel, units = 0, []
    held: list[tuple[int, int]] = []  # one unit: (layer, elements) the root holds
    plain: dict[int | None, int] = {}  # no FSDP: elements by block (None: the rest)

    sizes: dict[tuple, tuple[int, int]] = {}  # blocks of a kind shard alike

    def unit(name: str, params: list[tuple[str, tuple[int, ...]]], shard: int, group: str,
             reshard: bool, layer: int | None, moe_ffn: bool = False) -> None:
        nonlocal numel
        key = (tuple(params), shard, moe_ffn, group)
        if key not in sizes:
            index = {Mesh.MOE: at.moe, Mesh.EFSDP: at.efsdp}.get(group, at.fsdp)
            sizes[key] = _shard_numel(params, d, shapes, shard, moe_ffn, at, index)
        local, padded = sizes[key]
        numel += local
        if unwrapped:
            plain[layer] = plain.get(layer, 0) + local
        elif params and single and group == Mesh.DP_SHARD_CP and layer is not None:  # (padded == local)
            held.append((layer, padded))
        elif params:
            blocks = tuple(held) if layer is None else ()
            units.append(FsdpUnit(name, padded + sum(n for _, n in blocks), shard, group,
                                  d.dp_replicate, reshard, layer, blocks))

    for i in layers:
        # apply_fsdp: the last block of the rank stays gathered for backward; pipeline ranks keep all
        reshard = mode == "always" or (mode == "default" and i != layers[-1] and d.pp == 1)
        if not args.is_moe_layer(i):
            unit(f"layers.{i}", shapes["dense"], fsdp, Mesh.DP_SHARD_CP, reshard, i)
            continue
        routed, expert = shapes.routed + ".", shapes.experts + "."  # (the block plan's names)
        block = [(n, sh) for n, sh in shapes["moe_block"] if not n.startswith(routed)]
        ffn = [(n, sh) for n, sh in shapes["moe_block"] if n.startswith(routed)]
        experts = [(n, sh) for n, sh in ffn if n.startswith(expert)]
        rest = [(n, sh) for n, sh in ffn if not n.startswith(expert)]
        if single and moe_shard == 1:  # the root holds the routed feed-forward too
            block += ffn
        else:
            if d.ep > 1:
                unit(f"layers.{i}.{shapes.experts}", experts, moe_shard // d.ep, Mesh.EFSDP, reshard, i,
                     moe_ffn=True)
                experts = []
            unit(f"layers.{i}.{shapes.routed}", rest + experts, moe_shard, Mesh.MOE, reshard, i, moe_ffn=True)
        unit(f"layers.{i}", block, fsdp, Mesh.DP_SHARD_CP, reshard, i)
    roots = [(shapes["embedding"] if has_emb else []) + (shapes["head"] if has_head else [])]
    if run.stages_per_rank > 1:  # each stage view is a root of its own
        roots = [r for r, keep in ((shapes["embedding"], has_emb), (shapes["head"], has_head)) if keep]
    for params in roots:
        unit("(root)", params, fsdp, Mesh.DP_SHARD_CP, mode == "always", None)
    parts = tuple((i, plain[i]) for i in layers) + ((None, plain.get(None, 0)),) if unwrapped else ()
    return RankStates(pp_rank, 4 * numel, 4 * numel, optimizer_bytes_per_element(run.cfg) * numel,
                      tuple(units), tuple(layers), has_emb, has_head, parts)
