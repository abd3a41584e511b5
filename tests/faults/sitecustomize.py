"""Deliberate faults for negative controls -- tests only.

A test runs shardwise with ``PYTHONPATH=tests/faults`` and ``SHARDWISE_TEST_FAULT=<name>``: every
Python process of the run (the launcher and each rank) imports this file at start-up and breaks
exactly one thing, so the test can show that its tolerance catches that fault:

- ``drop_grad_reduction``: FSDP's gradient reduce-scatter still runs, but each rank keeps only its
  own gradient shard (a reduction lost on the way);
- ``double_grads``: every gradient is scaled by 2 before clipping (a normalization off by 2);
- ``drop_optimizer_state``: a loaded checkpoint's optimizer state is thrown away (Adam restarts).
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
        import shardwise.train as train

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
    else:
        raise SystemExit(f"SHARDWISE_TEST_FAULT={fault!r} is not a fault tests/faults/sitecustomize.py knows")


if os.environ.get("SHARDWISE_TEST_FAULT"):
    _install(os.environ["SHARDWISE_TEST_FAULT"])
