"""``ParallelDims``: checks the parallel degrees and owns the named DeviceMesh.

Mesh dims, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Every dim exists even at size 1
(a collective over a size-1 group is a no-op), so 1 rank and N ranks run the same code. Flattened
views are built once:

- ``dp``          = dp_replicate x dp_shard        (data loading: who reads which sequences)
- ``dp_shard_cp`` = dp_shard x cp                  (FSDP shards parameters over these ranks)
- ``dp_cp``       = dp_replicate x dp_shard x cp   (loss / valid-token all-reduce)
- ``dp_cp_tp``    = all but pp                     (MoE: every rank routes different tokens)
- ``cp_tp``       = cp x tp                        (MoE: the ranks that share one sequence)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from shardwise.config.model_args import ModelArgs
from shardwise.config.schema import ConfigError, ParallelConfig, coerce

if TYPE_CHECKING:  # torch loads when a mesh is built: the degree checks run before it (shardwise/cli.py)
    from torch.distributed.device_mesh import DeviceMesh



class Mesh(StrEnum):
    """Every mesh dim and flattened view, by name: code names a mesh through this, never a string
    (tests/unit/test_structure.py holds it). A member is its name as a ``str`` (``Mesh.TP == "tp"``),
    which is what DeviceMesh indexing, the planner's reports and their JSON read."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    DP = "dp"
    DP_SHARD_CP = "dp_shard_cp"
    DP_CP = "dp_cp"
    DP_CP_TP = "dp_cp_tp"
    CP_TP = "cp_tp"
    HSDP = "hsdp"
    DP_SHARD_CP_TP = "dp_shard_cp_tp"
    MOE = "moe"
    EP = "ep"
    EXPERTS = "experts"
    EFSDP = "efsdp"


MESH_DIMS = (Mesh.PP, Mesh.DP_REPLICATE, Mesh.DP_SHARD, Mesh.CP, Mesh.TP)
"""The world mesh's dims, outermost first (rank = row-major index over them)."""
DEGREES = (*MESH_DIMS, Mesh.EP)
"""The parallel degrees a layout sets (``ep`` borrows its ranks from dp_shard x cp x tp)."""
FLAT_VIEWS = {Mesh.DP: (Mesh.DP_REPLICATE, Mesh.DP_SHARD),
              Mesh.DP_SHARD_CP: (Mesh.DP_SHARD, Mesh.CP),
              Mesh.DP_CP: (Mesh.DP_REPLICATE, Mesh.DP_SHARD, Mesh.CP),
              Mesh.DP_CP_TP: (Mesh.DP_REPLICATE, Mesh.DP_SHARD, Mesh.CP, Mesh.TP),
              Mesh.CP_TP: (Mesh.CP, Mesh.TP)}
"""The flattened views :meth:`ParallelDims.build_mesh` makes, by name -> the mesh dims they span."""
MOE_VIEWS = {Mesh.DP_SHARD_CP_TP: (Mesh.DP_SHARD, Mesh.CP, Mesh.TP),
             Mesh.MOE: (Mesh.DP_SHARD, Mesh.CP, Mesh.TP)}
"""The views :meth:`ParallelDims.moe_meshes` makes (``moe``: the FSDP group of routers and shared
experts; ``ep`` and ``efsdp`` split it, innermost ``ep``)."""


class Degrees(NamedTuple):
    """The parallel degrees alone, as a hashable value (what the planner's rank arithmetic and its
    caches key on): :attr:`ParallelDims.degrees`."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def moe_shard(self) -> int:
        """dp_shard x cp x tp: the ranks an MoE block's router and experts are sharded over (expert
        parallel takes ``ep`` of them)."""
        return self.dp_shard * self.cp * self.tp


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    target_device: str = field(default="", repr=False)
    """The device type the model is parallelized for: the mesh's, or for the planner (whose fake
    world's mesh is on the CPU) the device of the run it plans (:func:`build_mesh`)."""
    _flat: dict[Mesh, DeviceMesh] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` and validate; raises ConfigError with a one-line message."""
        degrees = {k: getattr(cfg, k) for k in DEGREES}
        for k, v in degrees.items():
            if v < 1 and not (k == Mesh.DP_SHARD and v == -1):
                raise ConfigError(f"parallel.{k} must be >= 1 (dp_shard may be -1), got {v}")
        rest = degrees[Mesh.DP_REPLICATE] * degrees[Mesh.CP] * degrees[Mesh.TP] * degrees[Mesh.PP]
        if degrees[Mesh.DP_SHARD] == -1:
            if world_size % rest:
                raise ConfigError(f"world size {world_size} is not divisible by dp_replicate*cp*tp*pp"
                                  f"={rest}: change the degrees or the number of ranks")
            degrees[Mesh.DP_SHARD] = world_size // rest
        product = rest * degrees[Mesh.DP_SHARD]
        if product != world_size:
            raise ConfigError(
                f"parallel degrees pp*dp_replicate*dp_shard*cp*tp = {product} != world size "
                f"{world_size}: make the product equal the number of ranks or set dp_shard=-1")
        if not cfg.expert_load >= 1:
            raise ConfigError(f"parallel.expert_load must be >= 1 (the busiest expert's tokens over the "
                              f"mean; 1.0 = balanced), got {cfg.expert_load}")
        borrow = degrees[Mesh.DP_SHARD] * degrees[Mesh.CP] * degrees[Mesh.TP]
        if borrow % degrees[Mesh.EP]:
            raise ConfigError(f"parallel.ep={degrees[Mesh.EP]} must divide dp_shard*cp*tp={borrow} (expert "
                              "parallel borrows those ranks): change ep or the other degrees")
        return cls(world_size=world_size, **degrees)

    def check_model(self, args: ModelArgs, seq_len: int) -> None:
        """Divisibility of the model's heads/widths/layers and the sequence by the degrees that
        split them."""
        if args.n_heads % self.tp or args.n_kv_heads % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} must divide model.n_heads={args.n_heads} and "
                              f"model.n_kv_heads={args.n_kv_heads}")
        for what, size in (("the FFN hidden dim", args.ffn_hidden_dim),
                           ("model.vocab_size", args.vocab_size),
                           ("training.seq_len (sequence parallel)", seq_len)):
            if size % self.tp:
                raise ConfigError(f"parallel.tp={self.tp} must divide {what}={size}")
        if self.pp > 1 and args.tie_embeddings:
            raise ConfigError("model.tie_embeddings with parallel.pp > 1 is not available yet: set "
                              "model.tie_embeddings=false or pp=1")
        if self.tp > 1 and args.tie_embeddings:
            raise ConfigError("model.tie_embeddings with parallel.tp > 1 is not available yet: set "
                              "model.tie_embeddings=false or tp=1")
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ConfigError(f"parallel.cp={self.cp} needs training.seq_len={seq_len} divisible by "
                              f"2*cp={2 * self.cp} (each rank takes a head and a tail chunk)")
        if self.cp > 1 and self.tp > 1 and (seq_len // self.cp) % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} must divide the per-cp-rank sequence "
                              f"training.seq_len/cp={seq_len // self.cp} (sequence parallel)")
        if self.ep > 1 and not args.n_experts:
            raise ConfigError(f"parallel.ep={self.ep} needs an MoE model (model.n_experts > 0, e.g. "
                              "model.name=moe-debug): set ep=1")
        if args.n_experts and args.n_experts % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide model.n_experts={args.n_experts}")
        if args.n_layers < self.pp:
            raise ConfigError(f"parallel.pp={self.pp} exceeds model.n_layers={args.n_layers}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep)

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def build_mesh(self, device_type: str, backend_override: dict[str, str] | None = None,
                   target_device: str = "") -> DeviceMesh:
        """Create the world mesh (all five dims) and its flattened views. ``target_device``: the
        device the model is parallelized for when it is not the mesh's (the planner's fake world)."""
        from torch.distributed.device_mesh import init_device_mesh

        self.target_device = target_device or device_type
        shape = tuple(getattr(self, d) for d in MESH_DIMS)
        overrides = {dim: backend_options(*parse_backend_spec(dim, spec))
                     for dim, spec in (backend_override or {}).items()}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS,
                                backend_override=overrides or None)
        # torch wants flattened meshes kept by the caller rather than sliced from the root again.
        self._flat = {name: mesh[spans]._flatten(name) for name, spans in FLAT_VIEWS.items()}
        if self.dp_replicate > 1 and self.cp > 1:
            # HSDP over (dp_replicate, dp_shard x cp): a 2-D view made by unflattening dp_cp.
            self._flat[Mesh.HSDP] = self._flat[Mesh.DP_CP]._unflatten(
                0, (self.dp_replicate, self.dp_shard * self.cp), (Mesh.DP_REPLICATE, Mesh.DP_SHARD_CP))
        self._mesh = mesh
        return mesh

    def built_sizes(self) -> dict[str, int]:
        """Each dim and view of the mesh as torch built it (``DeviceMesh.size()`` of the world mesh's
        dims, the flattened views and, once made, the MoE views) -- what a checkpoint's manifest
        records as the mesh that ran, beside the degrees it was asked for."""
        sizes = dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True))
        return {**sizes, **{str(name): m.size() for name, m in self._flat.items()}}

    @property
    def flat_meshes(self) -> dict[Mesh, DeviceMesh]:
        """The flattened views (:data:`FLAT_VIEWS`, and the MoE ones once made) by name."""
        return dict(self._flat)

    def submesh(self, name: Mesh) -> DeviceMesh:
        """A mesh dim of the world mesh, or one of the flattened views (:data:`FLAT_VIEWS`)."""
        if name in self._flat:
            return self._flat[name]
        return self.mesh[name]

    def moe_meshes(self) -> dict[Mesh, DeviceMesh]:
        """Meshes of MoE blocks (built on first use, on every rank alike):

        - ``moe``: FSDP mesh of router and shared expert -- all of dp_shard x cp x tp (2-D with
          dp_replicate for HSDP): for an MoE block those ranks all hold different tokens;
        - ``ep``: the expert-parallel dim (1-D), borrowed from dp_shard x cp x tp;
        - ``experts``: FSDP mesh of the expert weights, the rest of dp_shard x cp x tp (``efsdp``),
          with dp_replicate for HSDP.
        """
        if Mesh.MOE in self._flat:
            return {k: self._flat[k] for k in (Mesh.MOE, Mesh.EP, Mesh.EXPERTS) if k in self._flat}
        shard = self.degrees.moe_shard
        all_but_pp = self._flat[Mesh.DP_CP_TP]
        if self.dp_replicate > 1:
            self._flat[Mesh.MOE] = all_but_pp._unflatten(0, (self.dp_replicate, shard),
                                                      (Mesh.DP_REPLICATE, Mesh.DP_SHARD_CP_TP))
        else:
            self._flat[Mesh.MOE] = self.mesh[Mesh.DP_SHARD, Mesh.CP, Mesh.TP]._flatten(Mesh.DP_SHARD_CP_TP)
        if self.ep > 1:
            grid = all_but_pp._unflatten(0, (self.dp_replicate, shard // self.ep, self.ep),
                                         (Mesh.DP_REPLICATE, Mesh.EFSDP, Mesh.EP))
            self._flat[Mesh.EP] = grid[Mesh.EP]
            experts = (Mesh.DP_REPLICATE, Mesh.EFSDP) if self.dp_replicate > 1 else Mesh.EFSDP
            self._flat[Mesh.EXPERTS] = grid[experts]
        return self.moe_meshes()

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D over dp_shard x cp for FSDP, or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
        if self.dp_replicate > 1:
            return self._flat[Mesh.HSDP] if self.cp > 1 else self.mesh[Mesh.DP_REPLICATE, Mesh.DP_SHARD]
        return self.submesh(Mesh.DP_SHARD if self.cp == 1 else Mesh.DP_SHARD_CP)


def backend_options(name: str, opts: dict[str, Any]) -> str | tuple[str, Any]:
    """A backend name, or (name, options object) for ``init_device_mesh``'s backend_override."""
    import torch.distributed as dist

    if not opts:
        return name
    if name == "gloo":
        o = dist.ProcessGroupGloo._Options()
        if "threads" in opts:
            o._threads = opts["threads"]
    else:  # ProcessGroupNCCL exists only in CUDA builds of torch
        o = dist.ProcessGroupNCCL.Options(is_high_priority_stream=opts.get("high_priority", False))
    if "timeout_s" in opts:
        o._timeout = timedelta(seconds=opts["timeout_s"])
    return name, o


BACKEND_OPTIONS: dict[str, dict[str, type]] = {
    "gloo": {"timeout_s": float, "threads": int},
    "nccl": {"timeout_s": float, "high_priority": bool},
}


def parse_backend_spec(dim: str, spec: str) -> tuple[str, dict[str, Any]]:
    """``"gloo:timeout_s=600:threads=4"`` -> ``("gloo", {"timeout_s": 600.0, "threads": 4})``."""
    if dim not in MESH_DIMS:
        raise ConfigError(f"parallel.backend_override names unknown mesh dim '{dim}'; use "
                          f"{', '.join(MESH_DIMS)}")
    name, *opts = spec.split(":")
    if name not in BACKEND_OPTIONS:
        raise ConfigError(f"parallel.backend_override {dim}={spec!r}: backend must be one of "
                          f"{', '.join(BACKEND_OPTIONS)}")
    parsed: dict[str, Any] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in BACKEND_OPTIONS[name]:
            raise ConfigError(f"parallel.backend_override {dim}: {name} has no option '{key}'; options: "
                              f"{', '.join(BACKEND_OPTIONS[name])}")
        parsed[key] = coerce(f"parallel.backend_override {dim} {key}", BACKEND_OPTIONS[name][key],
                              value, from_cli=True)
    return name, parsed
