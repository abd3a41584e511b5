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
from tests.references import AMP_MOE, STEPS, Reference, check_torch_amp, hf_params, step_trainer


@pytest.mark.parametrize(("loss", "one_rank"), [("auto", "fsdp"), ("plain", "fsdp"), ("auto", "plain")])
def test_trainer_step_matches_a_plain_pytorch_step(data_cache: str, loss: str, one_rank: str):
    """auto: the fused loss, gradients in forward; one_rank plain: no FSDP (parallel.one_rank)."""
    with one_rank_pg():
        cfg, args, run, model, optimizer, scheduler, loader = step_trainer(data_cache, loss,
                                                                           one_rank=one_rank)
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


@pytest.mark.parametrize("model", [(), AMP_MOE], ids=["dense", "moe"])
def test_one_rank_without_fsdp_is_torch_amp(data_cache: str, model: tuple[str, ...]):
    """parallel.one_rank = plain under bf16: the trainer's step is exactly torch's AMP written out by
    hand on an unwrapped copy of the same model (tests/references.py check_torch_amp), to 1e-7 over 3
    steps with accumulation and clipping; the parameters stay fp32 leaves (no FSDP, no DTensor)."""
    with one_rank_pg():
        check_torch_amp(data_cache, model, "cpu")


@pytest.mark.parametrize("one_rank", ["fsdp", "plain"])
def test_a_nonfinite_step_changes_nothing(data_cache: str, one_rank: str):
    """A NaN gradient norm: fused AdamW is told (its ``found_inf``, no host sync mid-step) and leaves
    every parameter, moment and step count as they were; the result says the step was not finite."""
    import torch

    from shardwise.parallel.tensor import full_value

    with one_rank_pg():
        _, _, run, model, optimizer, scheduler, loader = step_trainer(data_cache, one_rank=one_rank)
        loss = TokenLoss(run.loss_chunk)
        assert bool(train_step(model, optimizer, scheduler, loader.next_step(), run, loss).finite)

        def snapshot() -> list[torch.Tensor]:
            states = [v for st in optimizer.state.values() for v in st.values()]
            return [full_value(t).detach().clone() for t in [*model.parameters(), *states]]

        before = snapshot()
        got = train_step(model, optimizer, scheduler, loader.next_step(), run, loss, inject_nan=True)
        assert not bool(got.finite)
        after = snapshot()
        assert len(before) == len(after) > 3 * len(list(model.parameters()))
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b)


def test_one_rank_plain_on_many_ranks_says_so(capsys: pytest.CaptureFixture):
    """parallel.one_rank=plain on 2 ranks trains with FSDP (there is something to shard): a notice,
    not a refusal; on one rank, none."""
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.run import resolve_run
    from tests.helpers import ROOT

    cfg = load_config(ROOT / "configs" / "debug.toml", ["--parallel.one_rank=plain", "--run.device=cpu"])
    resolve_run(cfg, 2)
    assert "notice: parallel.one_rank=plain is for a run on one rank: these 2 ranks train with FSDP" in \
        capsys.readouterr().out
    resolve_run(cfg, 1)
    assert "one_rank" not in capsys.readouterr().out


QWEN3_MOE = ("--model.name=moe-debug", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
             "--model.n_kv_heads=2", "--model.qk_norm=true", "--model.n_experts=8", "--model.moe_top_k=2",
             "--model.moe_hidden_dim=32", "--model.n_shared_experts=0", "--model.n_dense_layers=0",
             "--model.moe_balance=none")
"""A tiny Qwen3-MoE (top-2 of 8, QK-norm, no shared expert), routing left to itself."""
DEEPSEEK_V3 = ("--model.name=deepseek-debug", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
               "--model.n_kv_heads=4", "--model.q_lora_rank=24", "--model.kv_lora_rank=16",
               "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4", "--model.v_head_dim=6",
               "--model.moe_hidden_dim=32", "--model.n_experts=8", "--model.moe_n_groups=4",
               "--model.moe_topk_groups=2", "--model.n_dense_layers=0", "--model.moe_balance=none")
"""A tiny DeepSeek-V3 (latent attention; sigmoid top-2 of 8 from the best 2 of 4 groups, a shared
expert), routing left to itself."""


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_routing_and_training_match_hugging_face(data_cache: str, family: str):
    """The trainer's MoE steps against HF's Qwen3-MoE or DeepSeek-V3 under the written-out loop, from the same
    weights and batches, 8 steps at the peak learning rate: the same loss, gradient norm and, every
    step, each block's expert load -- so a collapse seen in shardwise's runs is the recipe's (HF
    trained the same way collapses alike), not the code's. Balancing is off on both sides (HF has
    none of shardwise's kinds); each method is held to its own reference in test_moe.py."""
    steps = 8
    with one_rank_pg():
        cfg, args, run, model, optimizer, scheduler, loader = step_trainer(
            data_cache, "plain", model=QWEN3_MOE if family == "qwen3_moe" else DEEPSEEK_V3, steps=steps)
        ref = Reference(model, args, cfg.lr_scheduler.min_lr_ratio, steps=steps)
        ours = []
        for step in range(1, steps + 1):
            batches = loader.next_step()
            got = train_step(model, optimizer, scheduler, batches, run, TokenLoss(run.loss_chunk))
            loss, norm, _, _ = ref.step(batches, step)
            ours.append(got.expert_load.tolist())
            assert float(got.loss) == pytest.approx(loss, rel=1e-5), step
            assert float(got.grad_norm) == pytest.approx(norm, rel=1e-4), step
        # Every block's busiest expert took the same number of the step's 1024 routing slots on both
        # sides (one slot more is a load 1/128 higher): the same float, step by step.
        assert ours == ref.loads
        assert max(max(x) for x in ours) > 1.2  # (routing moved: the comparison saw real imbalance)
