"""Deliberate faults for negative controls -- tests only.

A test runs shardwise with ``PYTHONPATH=tests/faults`` and ``SHARDWISE_TEST_FAULT=<name>[,<name>]``: every
Python process of the run (the launcher and each rank) imports this file at start-up and breaks
exactly one thing, so the test can show that its tolerance catches that fault:

- ``drop_grad_reduction``: FSDP's gradient reduce-scatter still runs, but each rank keeps only its
  own gradient shard (a reduction lost on the way);
- ``double_grads``: every gradient is scaled by 2 before clipping (a normalization off by 2);
- ``drop_optimizer_state``: a loaded checkpoint's optimizer state is thrown away (Adam restarts);
- ``tp_forget_reduction``: block 1's feed-forward output projection under tensor parallel returns
  this rank's partial sums, never reduced (a TP plan that forgets a reduction);
- ``skip_tp``: tensor parallel is never applied: the mesh has its tp dim, every module stays whole
  on every tp rank (a parallel flag silently dropped);
- ``fsdp_unit_grad_scale``: block 1's FSDP unit (a pipeline stage's first, where it has not block 1)
  reduces its gradients scaled by 2 (over 2+ ranks);
- ``hsdp_skip_replicate``: FSDP reduce-scatters each gradient over dp_shard but never all-reduces it
  over dp_replicate (each replica steps on its own share of the batch; invisible when dp_replicate=1);
- ``pp_wrong_microbatch``: the first pipeline stage is fed micro-batch m+1's tokens as micro-batch m;
- ``pp_drop_remainder``: the pipeline split gives each stage ``n_layers // stages`` blocks: where
  the stages do not divide the blocks, the last ones are held by no stage;
- ``cp_skip_hop``: block 1's ring attention (forward) uses a rank's own K/V where the neighbour's
  should arrive: one hop of the ring skipped;
- ``ep_wrong_rank``: block 1's expert all-to-all sends expert 1's tokens to expert 2's rank and
  back (and 2's to 1's);
- ``ep_experts_by_modulo``: every MoE block's all-to-all places expert ``e`` on rank ``e % ep``
  (the dispatch's side) while the weights are cut in blocks of ``E / ep`` experts (the partition's
  side): invisible when each rank holds one expert (``E == ep``);
- ``perturb_ffn_step3``: block 1's feed-forward adds 1e-3 to its output in its third training
  forward (step 3 with one micro-batch): a one-step change for ``shardwise compare`` to find;
- ``near_tie_router`` (not a fault of the code: a hard input): at init, every MoE router's expert 1
  gets expert 0's gate row plus a perturbation of ~1e-7, so which of the two a token prefers is
  decided by rounding -- a layout that sums in another order breaks such ties the other way;
- ``enospc_export``: the disk is full when an HF export writes its safetensors (a failing writer);
- ``rank1_raises``: rank 1 raises a RuntimeError at its first gradient clip (one rank of a
  launched run crashing, its peers then losing it);
- ``one_gpu`` (not a fault of the code: a machine): torch reports CUDA available with one device,
  for the checks that run before any CUDA call.
"""

import os


def _install(fault: str) -> None:
    if fault == "drop_grad_reduction":
        import torch.distributed as dist

        real = dist.reduce_scatter_single

        def reduce_scatter_single(output, input, *args, **kwargs):  # noqa: A002, ANN001, ANN002, ANN003, ANN202
            work = real(output, input, *args, **kwargs)
            group = kwargs.get("group")
            n, r = dist.get_world_size(group), dist.get_rank(group)
            output.copy_(input.view(n, -1)[r].view_as(output))  # this rank's own share only
            return work

        dist.reduce_scatter_single = reduce_scatter_single
    elif fault == "double_grads":
        import shardwise.trainer.train as train

        real_clip = train.clip_grad_norm_

        def clip_grad_norm_(parameters, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            parameters = list(parameters)
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(2)
            return real_clip(parameters, *args, **kwargs)

        train.clip_grad_norm_ = clip_grad_norm_
    elif fault == "drop_optimizer_state":
        import shardwise.checkpoint as checkpoint

        real_load = checkpoint.load

        def load(path, model, optimizer, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            step = real_load(path, model, optimizer, *args, **kwargs)
            optimizer.state.clear()
            return step

        checkpoint.load = load
    elif fault == "near_tie_router":
        import torch

        import shardwise.trainer.build as build
        from shardwise.models.moe import moe_layers

        real_init = build.init_weights

        def init_weights(model, seed):  # noqa: ANN001, ANN202
            real_init(model, seed)
            with torch.no_grad():
                for moe in moe_layers(model):
                    w = moe.router.gate.weight
                    w = w.to_local() if hasattr(w, "to_local") else w
                    if w.shape[0] == moe.n_experts:  # the whole gate (one rank: the verify reference)
                        g = torch.Generator().manual_seed(seed)
                        w[1] = w[0] + 1e-7 * w[0].abs().mean() * torch.randn(w.shape[1], generator=g)

        build.init_weights = init_weights
    elif fault == "tp_forget_reduction":
        import torch.nn.functional as F

        import shardwise.parallel.parallelize as parallelize

        real_tp = parallelize.apply_tp

        def apply_tp(model, mesh, cfg):  # noqa: ANN001, ANN202
            real_tp(model, mesh, cfg)
            rank, n = mesh.get_local_rank(), mesh.size()

            def partial_sums(module, args, out):  # noqa: ANN001, ANN202
                x, w = args[0], module.weight
                x, w = (t.to_local() if hasattr(t, "to_local") else t for t in (x, w))
                return F.linear(x, w).chunk(n, dim=1)[rank]  # this rank's partial sums, never summed

            model.layers["1"].feed_forward.w2.register_forward_hook(partial_sums)

        parallelize.apply_tp = apply_tp
    elif fault == "skip_tp":
        import shardwise.parallel.parallelize as parallelize

        parallelize.apply_tp = lambda model, mesh, cfg: None
    elif fault == "fsdp_unit_grad_scale":
        import shardwise.parallel.parallelize as parallelize

        real_fsdp = parallelize.apply_fsdp

        def apply_fsdp(model, mesh, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            real_fsdp(model, mesh, *args, **kwargs)
            if mesh.size() > 1:  # (a pipeline stage without block 1: its first block)
                key = "1" if "1" in model.layers else next(iter(model.layers))
                model.layers[key].set_gradient_divide_factor(0.5)  # this unit's reduction doubled

        parallelize.apply_fsdp = apply_fsdp
    elif fault == "hsdp_skip_replicate":
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

        real_reduce = param_group.foreach_reduce

        def foreach_reduce(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            args = list(args)
            args[9] = None  # all_reduce_group: HSDP's replicas are never summed
            return real_reduce(*args, **kwargs)

        param_group.foreach_reduce = foreach_reduce
    elif fault == "pp_wrong_microbatch":
        import dataclasses

        import shardwise.parallel.pipeline as pipeline

        real_step = pipeline.Pipe.forward_backward

        def forward_backward(self, batches, n_valid):  # noqa: ANN001, ANN202
            if self.is_first and len(batches) > 1:  # the first stage gets micro-batch m+1's tokens as m's
                batches = [dataclasses.replace(b, inputs=batches[(i + 1) % len(batches)].inputs)
                           for i, b in enumerate(batches)]
            return real_step(self, batches, n_valid)

        pipeline.Pipe.forward_backward = forward_backward
    elif fault == "pp_drop_remainder":
        import shardwise.parallel.pipeline as pipeline
        import shardwise.parallel.stages as stages

        def stage_layers(n_layers, n_stages):  # noqa: ANN001, ANN202
            base = n_layers // n_stages  # (the remainder's blocks go to no stage)
            return [list(range(s * base, (s + 1) * base)) for s in range(n_stages)]

        stages.stage_layers = pipeline.stage_layers = stage_layers
    elif fault == "cp_skip_hop":
        import torch
        import torch.distributed.tensor.experimental._context_parallel._attention as ring

        import shardwise.parallel.parallelize as parallelize

        real_cp, real_rotater = parallelize.apply_cp, ring._create_rotater
        skipping = [False]

        class SkippingRotater:
            """Passes its own K/V on instead of the neighbour's: one hop of the ring skipped."""

            def __init__(self, inner):  # noqa: ANN001
                self.inner, self.own = inner, None

            def exchange_buffers(self, buffer):  # noqa: ANN001, ANN202
                self.own = buffer
                return self.inner.exchange_buffers(buffer)

            def next_buffer(self):  # noqa: ANN202
                got = self.inner.next_buffer()
                return self.own if self.own is not None else got

        def create_rotater(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            rotater = real_rotater(*args, **kwargs)
            return SkippingRotater(rotater) if skipping[0] else rotater

        def apply_cp(model, mesh, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            real_cp(model, mesh, *args, **kwargs)
            core = model.layers["1"].attention.core  # block 1's forward only
            core.register_forward_pre_hook(lambda *a: skipping.__setitem__(0, torch.is_grad_enabled()))
            core.register_forward_hook(lambda *a: skipping.__setitem__(0, False))

        ring._create_rotater, parallelize.apply_cp = create_rotater, apply_cp
    elif fault == "ep_wrong_rank":
        import torch

        import shardwise.parallel.expert as expert

        class Misrouting(expert.ExpertParallel):
            """Expert 1's tokens go to expert 2's rank (and 2's to 1's), their outputs come back."""

            def _dispatch(self, module, inputs, mesh):  # noqa: ANN001, ANN202
                x, counts = inputs
                bounds = [0, *torch.cumsum(counts, 0).tolist()]
                rows = [torch.arange(bounds[e], bounds[e + 1]) for e in range(len(counts))]
                rows[1], rows[2] = rows[2], rows[1]
                self.order = torch.cat(rows)
                swapped = counts.clone()
                swapped[1], swapped[2] = counts[2], counts[1]
                return super()._dispatch(module, (x.index_select(0, self.order), swapped), mesh)

            def _combine(self, module, out, mesh):  # noqa: ANN001, ANN202
                out = super()._combine(module, out, mesh)
                return out.index_select(0, torch.argsort(self.order))

        def apply_ep(model, mesh):  # noqa: ANN001, ANN202
            for key, block in model.layers.items():
                if block.plan.experts:
                    kind = Misrouting if key == "1" else expert.ExpertParallel
                    kind().apply(block.get_submodule(block.plan.experts), mesh)

        import shardwise.parallel.parallelize as parallelize

        parallelize.apply_ep = apply_ep
    elif fault == "ep_experts_by_modulo":
        import torch

        import shardwise.parallel.expert as expert
        import shardwise.parallel.parallelize as parallelize

        class ByModulo(expert.ExpertParallel):
            """Expert e's slots go to the slot block of rank e % ep, local expert e // ep."""

            def _dispatch(self, module, inputs, mesh):  # noqa: ANN001, ANN202
                x, counts = inputs
                ep, n = mesh.size(), counts.numel()
                ids = torch.arange(n, device=counts.device)
                placed = (ids % ep) * (n // ep) + ids // ep  # (E,) the block position given expert e
                self.order = torch.argsort(placed[torch.repeat_interleave(ids, counts)], stable=True)
                moved = (x.index_select(0, self.order), counts[torch.argsort(placed)])
                return super()._dispatch(module, moved, mesh)

            def _combine(self, module, out, mesh):  # noqa: ANN001, ANN202
                return super()._combine(module, out, mesh).index_select(0, torch.argsort(self.order))

        def apply_ep(model, mesh):  # noqa: ANN001, ANN202
            for block in model.layers.values():
                if block.plan.experts:
                    ByModulo().apply(block.get_submodule(block.plan.experts), mesh)

        parallelize.apply_ep = apply_ep
    elif fault == "perturb_ffn_step3":
        import torch

        import shardwise.models.layers as layers
        import shardwise.trainer.build as build

        real_build, real_forward = build.build_model, layers.FeedForward.forward

        def build_model(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            model = real_build(*args, **kwargs)
            model.layers["1"].feed_forward.perturb_calls = 0  # the one module this fault changes
            return model

        def forward(self, x):  # noqa: ANN001, ANN202
            out = real_forward(self, x)
            if hasattr(self, "perturb_calls") and torch.is_grad_enabled():
                self.perturb_calls += 1
                if self.perturb_calls == 3:  # its third training forward: step 3 (one micro-batch)
                    out = out + 1e-3
            return out

        build.build_model, layers.FeedForward.forward = build_model, forward
    elif fault == "enospc_export":
        import errno

        import safetensors.torch

        def save_file(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
            raise OSError(errno.ENOSPC, "No space left on device")

        safetensors.torch.save_file = save_file
    elif fault == "rank1_raises":
        import shardwise.trainer.train as train

        real_clip = train.clip_grad_norm_

        def clip_grad_norm_(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if os.environ.get("RANK") == "1":
                raise RuntimeError("planted: rank 1 fails at its first step")
            return real_clip(*args, **kwargs)

        train.clip_grad_norm_ = clip_grad_norm_
    elif fault == "one_gpu":
        import torch

        torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)
    else:
        raise SystemExit(f"SHARDWISE_TEST_FAULT={fault!r} is not a fault tests/faults/sitecustomize.py knows")


for _fault in filter(None, os.environ.get("SHARDWISE_TEST_FAULT", "").split(",")):
    _install(_fault)
