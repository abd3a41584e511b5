"""The trainer's own step against an independent one.

Layout-vs-layout parity cannot see an error that every layout shares (a gradient scale, a missing
weight decay, a clipping or learning-rate slip): here the trainer's ``train_step`` on one rank --
its FSDP-wrapped model, fused AdamW, global-norm clipping, global-token normalization over
accumulated micro-batches, warmup -- is compared with a step written out by hand on Hugging Face's
``LlamaForCausalLM`` holding the same weights: one batch, the mean token loss over every valid label,
an L2 norm and a clip coefficient, and AdamW's update rule in a few lines.
"""

from __future__ import annotations

import pytest

from shardwise.trainer.loss import TokenLoss
from shardwise.trainer.train import train_step
from tests.helpers import one_rank_pg
from tests.references import STEPS, Reference, hf_params, step_trainer


@pytest.mark.parametrize("loss", ["auto", "plain"])  # auto: the fused loss, gradients in forward
def test_trainer_step_matches_a_plain_pytorch_step(data_cache: str, loss: str):
    with one_rank_pg():
        cfg, args, run, model, optimizer, scheduler, loader = step_trainer(data_cache, loss)
        assert (run.loss_chunk > 0) == (loss == "auto")
        ref = Reference(model, args, cfg.lr_scheduler.min_lr_ratio)
        clipped = 0
        for step in range(1, STEPS + 1):
            batches = loader.next_step()
            got = train_step(model, optimizer, scheduler, batches, run, TokenLoss(run.loss_chunk))
            loss, norm, lr, coef = ref.step(batches, step)
            clipped += coef < 1.0
            assert float(got.loss) == pytest.approx(loss, rel=2e-6), step
            assert float(got.grad_norm) == pytest.approx(norm, rel=2e-5), step
            assert got.lr == pytest.approx(lr, rel=1e-12), step
        assert clipped >= 2  # the clip path was taken, not just measured
        ours = hf_params(model, args)
        for name, p in ref.hf.named_parameters():  # every tensor, relative to how far it moved
            err = (ours[name] - p.detach()).norm() / (p.detach() - ref.start[name]).norm()
            assert err <= 1e-4, f"{name}: {err:.2e} of the update"


def test_the_reference_catches_a_wrong_token_count(data_cache: str):
    """Negative control: the step_trainer normalizing by half the valid tokens (a count that missed half
    the ranks or micro-batches) reports twice the loss and gradient norm -- far outside the bounds
    above."""
    with one_rank_pg():
        cfg, args, run, model, optimizer, scheduler, loader = step_trainer(data_cache)
        ref = Reference(model, args, cfg.lr_scheduler.min_lr_ratio)
        batches = loader.next_step()
        loss, norm, _, _ = ref.step(batches, 1)
        for b in batches:
            b.n_valid //= 2
        got = train_step(model, optimizer, scheduler, batches, run, TokenLoss(run.loss_chunk))
        assert float(got.loss) / loss == pytest.approx(2.0, rel=1e-2)
        assert float(got.grad_norm) / norm == pytest.approx(2.0, rel=1e-2)


def test_one_fsdp_unit_trains_bit_identically(data_cache: str, monkeypatch: pytest.MonkeyPatch):
    """The GPU's FSDP layout on one rank -- the whole model one unit (parallel/fsdp.py one_unit) --
    against the CPU's per-block units: the same casts in the same places, so the same bits (bf16
    compute, fp32 master weights, 3 steps with clipping and accumulation)."""
    from torch.distributed.fsdp import FSDPModule

    from shardwise.parallel import fsdp

    runs = []
    for devices in (("cuda",), ("cuda", "cpu")):
        monkeypatch.setattr(fsdp, "ONE_UNIT_DEVICES", devices)
        with one_rank_pg():
            cfg, args, run, model, optimizer, scheduler, loader = step_trainer(data_cache, precision="bf16")
            units = sum(isinstance(m, FSDPModule) for m in model.modules())
            loss = TokenLoss(run.loss_chunk)
            steps = [train_step(model, optimizer, scheduler, loader.next_step(), run, loss)
                     for _ in range(STEPS)]
            runs.append((units, [(float(r.loss), float(r.grad_norm)) for r in steps]))
    (blocks, per_block), (one, whole) = runs
    assert (blocks, one) == (args.n_layers + 1, 1)
    assert per_block == whole
