"""The trainer's own step against an independent one.

Layout-vs-layout parity cannot see an error that every layout shares (a gradient scale, a missing
weight decay, a clipping or learning-rate slip): here the trainer's ``train_step`` on one rank --
its FSDP-wrapped model, fused AdamW, global-norm clipping, global-token normalization over
accumulated micro-batches, warmup -- is compared with a step written out by hand on Hugging Face's
``LlamaForCausalLM`` holding the same weights: one batch, the mean token loss over every valid label,
an L2 norm and a clip coefficient, and AdamW's update rule in a few lines.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.checkpoint.hf import hf_config, to_hf_state
from shardwise.data.dataset import IGNORE_INDEX
from shardwise.optim.adamw import build_optimizer
from shardwise.optim.lr import build_lr_scheduler
from shardwise.parallel.tensor import full_value
from shardwise.resolve.checks import load_config
from shardwise.resolve.run import resolve_run
from shardwise.trainer.build import build_rank_model
from shardwise.trainer.loss import TokenLoss
from shardwise.trainer.session import build_data
from shardwise.trainer.train import train_step
from tests.conftest import ROOT, one_rank_pg, require

STEPS = 3
PEAK_LR, WARMUP, WD, BETAS, EPS, MAX_NORM = 3e-3, 2, 0.1, (0.9, 0.95), 1e-8, 0.25


def _hf_params(model: torch.nn.Module, args) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return to_hf_state({k: full_value(v).detach().clone() for k, v in model.state_dict().items()}, args)


class Reference:
    """Hugging Face's Llama with the trainer's initial weights, and a training step written out."""

    def __init__(self, model: torch.nn.Module, args, min_lr_ratio: float) -> None:  # noqa: ANN001
        transformers = require("transformers")
        params = _hf_params(model, args)
        self.hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(args, "fp32")))
        self.hf.to(next(iter(params.values())).device)
        self.hf.load_state_dict(params)
        self.start = {k: v.detach().clone() for k, v in self.hf.named_parameters()}
        self.moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in self.hf.named_parameters()}
        self.min_lr_ratio = min_lr_ratio

    def step(self, batches: list, step: int) -> tuple[float, float, float, float]:
        """(loss, grad norm, lr, clip coefficient) of optimizer step ``step`` on ``batches``."""
        # Loss: the mean over every valid label of the whole global batch, in one forward.
        inputs = torch.cat([b.inputs for b in batches])  # (8, 64)
        labels = torch.cat([b.labels for b in batches])
        logits = self.hf(inputs).logits.float()  # (8, 64, V)
        n_valid = (labels != IGNORE_INDEX).sum()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / n_valid
        self.hf.zero_grad()
        loss.backward()
        with torch.no_grad():
            norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in self.hf.parameters()))
            coef = min(1.0, MAX_NORM / (norm + 1e-6))
            lr = PEAK_LR * step / WARMUP  # linear warmup, then cosine down to min_lr_ratio
            if step > WARMUP:
                shape = 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))
                lr = PEAK_LR * (self.min_lr_ratio + (1 - self.min_lr_ratio) * shape)
            for name, p in self.hf.named_parameters():  # AdamW, decoupled decay on matrices only
                g = p.grad * coef
                m, v = self.moments[name]
                m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                if p.dim() >= 2:
                    p.mul_(1 - lr * WD)
                m_hat, v_hat = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
                p.sub_(lr * m_hat / (v_hat.sqrt() + EPS))
        return float(loss), norm, lr, coef


def trainer(data_cache: str, loss: str = "auto", device: str = "cpu", precision: str = "fp32"):  # noqa: ANN201
    """The trainer's own pieces on one rank: model, optimizer, schedule, data (inside one_rank_pg,
    or a one-rank NCCL group on a GPU)."""
    cfg = load_config(ROOT / "configs" / "debug.toml", [
        "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.multiple_of=16", "--training.seq_len=64", "--training.global_batch=8",
        "--training.micro_batch=2",  # 4 accumulated micro-batches: the normalization spans them
        f"--training.mixed_precision={precision}", f"--training.steps={STEPS}",
        f"--training.max_grad_norm={MAX_NORM}", f"--optimizer.lr={PEAK_LR}", f"--optimizer.weight_decay={WD}",
        f"--lr_scheduler.warmup_steps={WARMUP}", f"--data.cache_dir={data_cache}",
        "--debug.deterministic=true", f"--training.loss={loss}", f"--run.device={device}"])
    run = resolve_run(cfg, 1)
    run.dims.build_mesh(device)
    model = build_rank_model(run, device)
    optimizer = build_optimizer(model, cfg.optimizer, device)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, STEPS)
    loader, _ = build_data(run, torch.device(device))
    return cfg, run.model, run, model, optimizer, scheduler, loader


@pytest.mark.parametrize("loss", ["auto", "plain"])  # auto: the fused loss, gradients in forward
def test_trainer_step_matches_a_plain_pytorch_step(data_cache: str, loss: str):
    with one_rank_pg():
        cfg, args, run, model, optimizer, scheduler, loader = trainer(data_cache, loss)
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
        ours = _hf_params(model, args)
        for name, p in ref.hf.named_parameters():  # every tensor, relative to how far it moved
            err = (ours[name] - p.detach()).norm() / (p.detach() - ref.start[name]).norm()
            assert err <= 1e-4, f"{name}: {err:.2e} of the update"


def test_the_reference_catches_a_wrong_token_count(data_cache: str):
    """Negative control: the trainer normalizing by half the valid tokens (a count that missed half
    the ranks or micro-batches) reports twice the loss and gradient norm -- far outside the bounds
    above."""
    with one_rank_pg():
        cfg, args, run, model, optimizer, scheduler, loader = trainer(data_cache)
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
            cfg, args, run, model, optimizer, scheduler, loader = trainer(data_cache, precision="bf16")
            units = sum(isinstance(m, FSDPModule) for m in model.modules())
            loss = TokenLoss(run.loss_chunk)
            steps = [train_step(model, optimizer, scheduler, loader.next_step(), run, loss)
                     for _ in range(STEPS)]
            runs.append((units, [(float(r.loss), float(r.grad_norm)) for r in steps]))
    (blocks, per_block), (one, whole) = runs
    assert (blocks, one) == (args.n_layers + 1, 1)
    assert per_block == whole
