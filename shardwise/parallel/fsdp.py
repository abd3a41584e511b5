"""FSDP2 (``fully_shard``) and HSDP with a mixed-precision policy.

Gradient reduction is a plain SUM: the trainer divides each micro-batch loss by the number of valid
tokens in the whole global batch, so summing the ranks' gradients gives exactly the single-device
gradient. (FSDP's default would average over ranks.) ``set_gradient_divide_factor`` alone selects
``PREMUL_SUM``, which gloo rejects, so the factor is paired with forced sum reductions.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from shardwise.config.schema import ParallelConfig
from shardwise.models.protocol import blocks
from shardwise.parallel.dims import Mesh

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mixed_precision_policy(mixed_precision: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16: parameters cast to bf16 for compute, gradients reduced in ``reduce_dtype``."""
    if mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[reduce_dtype])


ONE_UNIT_DEVICES = ("cuda",)
"""Devices where a one-rank FSDP mesh wraps the model as one unit (:func:`one_unit`)."""


def one_unit(fsdp_ranks: int, pp: int, device_type: str) -> bool:
    """Whether FSDP wraps the whole model as one unit (the root): when its mesh has one rank (no data
    parallel; ``fsdp_ranks`` counts dp_replicate x dp_shard x cp), there is no pipeline, and the
    device is a GPU.

    Per-block units exist to overlap each block's all-gather and reduce-scatter with compute and to
    free each block's gathered copy after use. On one rank there is nothing to gather or reduce --
    FSDP only casts the parameters to the compute dtype and the gradients back -- and on a GPU each
    unit's hooks, stream syncs and copies are host time the kernels wait for, which made small
    models much slower on a GPU (BENCHMARKS.md). One unit keeps the
    compute-dtype copy of the parameters until backward ends (as autocast keeps its cast weights)
    and reduces all gradients at once at the end. On a CPU the step is compute-bound, so one unit
    gains nothing there and its whole-model reduce buffers cost memory: CPUs keep per-block units."""
    return fsdp_ranks == 1 and pp == 1 and device_type in ONE_UNIT_DEVICES


PLAIN_DEVICES = ("cuda",)
"""Devices where a one-rank run trains without FSDP under ``parallel.one_rank = auto``."""


def plain_rank(world_size: int, device_type: str, choice: str) -> bool:
    """Whether a run trains without FSDP (``parallel.one_rank``): only on one rank; ``auto`` on a GPU.

    On one rank FSDP gathers and reduces nothing, yet its mixed precision costs whole passes over the
    parameters and gradients every step: the cast to the bf16 copy, the copy-out, the gradients packed
    into an fp32 reduce buffer, the one-rank "reduce" (a copy) and an fp32 scaling pass: a tenth of a
    GPU step or more (bench/results/history.md, "Beside torchtitan"). Without it, autocast casts each
    weight where a matmul reads it (fused into the compiled blocks) and autograd accumulates fp32
    gradients in place. On a CPU ``auto`` keeps FSDP: there the one-rank run is the reference every
    multi-rank layout is compared against, and FSDP's bf16 parameter copies round as a multi-rank run's
    do."""
    if world_size != 1 or choice == "fsdp":
        return False
    return choice == "plain" or device_type in PLAIN_DEVICES


def apply_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run every forward of ``model`` (training, evaluation, generation) under ``torch.autocast``:
    entered by a forward pre-hook, left by a forward hook that also runs when forward raises.
    Backward needs no context: autograd recorded each op's dtypes. Code that casts by hand (grouped
    GEMMs and the fused loss: autocast knows neither) asks torch's autocast state
    (``ops.autocast.compute_dtype``)."""
    contexts: list[torch.autocast] = []

    def enter(module: nn.Module, args: tuple) -> None:
        contexts.append(torch.autocast(device_type, dtype=dtype))
        contexts[-1].__enter__()

    def leave(module: nn.Module, args: tuple, out: object) -> None:
        contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig,
               mp_policy: MixedPrecisionPolicy, moe_meshes: dict[str, DeviceMesh] | None = None,
               device_type: str = "") -> None:
    """Shard each transformer block, then the root (embeddings, final norm, output head).

    One FSDP group per block lets the next block's all-gather overlap this block's compute. The
    root keeps its parameters gathered after forward (backward needs the output head first).
    A block's routed feed-forward (``block.plan.routed``: an MoE's) is its own group on
    ``moe_meshes["moe"]`` (all ranks that route different tokens), with its experts in a group of
    their own on ``moe_meshes["experts"]`` under expert parallel. With an FSDP mesh of one rank
    (:func:`one_unit`) the blocks are not wrapped: the root holds them (a routed feed-forward whose
    own mesh spans ranks stays a group).
    ``device_type``: the device the units are for when it is not the mesh's (the planner's fake
    world plans a GPU's units on a CPU mesh).
    """
    layers = blocks(model)
    # A block's hidden-state input is already in the compute dtype (the root's embedding produced
    # it); casting its floating inputs would only round the fp32 RoPE table to bf16.
    block_mp = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    single = one_unit(mesh.size(), cfg.pp, device_type or mesh.device_type)
    for i, block in enumerate(layers):
        if cfg.reshard_after_forward == "never":
            reshard = False
        elif cfg.reshard_after_forward == "always":
            reshard = True
        else:  # default: the last block's parameters are needed again first in backward, and
            # under PP every block's are, once per micro-batch: keep them gathered.
            reshard = i < len(layers) - 1 and cfg.pp == 1
        plan = block.plan
        if plan.routed and not (single and moe_meshes[Mesh.MOE].size() == 1):
            if Mesh.EXPERTS in (moe_meshes or {}):
                fully_shard(block.get_submodule(plan.experts), mesh=moe_meshes[Mesh.EXPERTS],
                            mp_policy=block_mp, reshard_after_forward=reshard)
            fully_shard(block.get_submodule(plan.routed), mesh=moe_meshes[Mesh.MOE], mp_policy=block_mp,
                        reshard_after_forward=reshard)
        if not single:
            fully_shard(block, mesh=mesh, mp_policy=block_mp, reshard_after_forward=reshard)
    root_reshard = cfg.reshard_after_forward == "always"
    # Several pipeline stages on this rank run as views of this module, whose own forward never
    # runs: each view is an FSDP root instead (owning the embedding / head of its stage).
    roots = getattr(model, "stage_views", None) or [model]
    for root in roots:
        fully_shard(root, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=root_reshard)
    for m in [*model.modules(), *roots]:
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
