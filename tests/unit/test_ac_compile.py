"""Activation checkpointing modes and torch.compile per block against the plain model: the same
loss and gradients; checkpointing recomputes what its policy says (counted matmuls and SiLUs) and
holds fewer activation bytes (torch's MemTracker)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.config.schema import ActivationCheckpointConfig
from shardwise.models import PRESETS
from shardwise.models.transformer import build_model, init_weights
from shardwise.parallel.ac import apply_ac
from shardwise.parallel.compile import apply_compile

ARGS = dataclasses.replace(PRESETS["debug"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                           vocab_size=512, max_seq_len=256)
TOKENS = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(0))


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def model(mode: str = "none", every: int = 2) -> torch.nn.Module:
    m = build_model(ARGS, device="cpu")
    init_weights(m, 0)
    apply_ac(m, ActivationCheckpointConfig(mode=mode, every=every))
    return m


def loss_of(m: torch.nn.Module) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(TOKENS).flatten(0, 1), TOKENS.roll(-1, 1).flatten())


def run(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter, float]:
    m = model(mode)
    loss = loss_of(m)
    counter = OpCounter()
    with counter:
        loss.backward()
    tracked = model(mode)
    tracker = MemTracker()
    tracker.track_external(tracked)
    with tracker:
        loss_of(tracked).backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    activations = next(v for k, v in peak.items() if getattr(k, "value", None) == "Activation")
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, counter.calls, activations


@pytest.fixture(scope="module")
def plain() -> tuple:
    return run("none")


@pytest.mark.parametrize("mode", ["full", "selective", "selective_half", "layer"])
def test_checkpointing_gives_the_same_loss_and_gradients(mode: str, plain: tuple):
    loss, grads, calls, activations = run(mode)
    ref_loss, ref_grads, ref_calls, ref_activations = plain
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=name)
    recomputed_mm = calls["mm"] - ref_calls["mm"]
    if mode == "selective":  # matmul outputs kept, elementwise ops (SiLU) recomputed
        assert recomputed_mm == 0 and calls["silu"] == ARGS.n_layers and ref_calls["silu"] == 0
    elif mode == "selective_half":  # of wq wk wv wo w1 w3 w2, the 2nd, 4th and 6th again
        assert recomputed_mm == 3 * ARGS.n_layers and calls["silu"] == ARGS.n_layers
    elif mode == "full":  # every block's matmuls (but the last down projection, never needed) again
        assert recomputed_mm >= 5 * ARGS.n_layers and calls["silu"] == ARGS.n_layers
    else:  # layer, every 2nd block: block 0 of 2
        assert 0 < recomputed_mm < 5 * ARGS.n_layers and calls["silu"] == 1
    assert activations < ref_activations


def test_memory_order_full_below_selective_below_none(plain: tuple):
    full, half, selective = run("full")[3], run("selective_half")[3], run("selective")[3]
    assert full < half < selective < plain[3]


def test_names_unchanged():
    """Checkpointing wraps forward in place: parameter names (init seeds, checkpoints) stay."""
    assert [n for n, _ in model("full").named_parameters()] == [n for n, _ in model().named_parameters()]


@pytest.mark.parametrize("mode", ["selective", "selective_half"])
def test_compile_with_selective_checkpointing_matches_eager(plain: tuple, mode: str):
    m = model(mode)
    apply_compile(m, True)
    loss = loss_of(m)
    loss.backward()
    ref_loss, ref_grads = plain[0], plain[1]
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert all(b._compiled_call_impl is not None for b in m.layers.values())


# (the DeepSeek-V3 case runs the same grouped experts in make test; moe-debug's in make test-all)
@pytest.mark.parametrize("preset", [pytest.param("moe-debug", marks=pytest.mark.slow), "deepseek-debug"])
def test_compiled_moe_blocks_match_eager_in_fp32(preset: str):
    """MoE blocks compiled in fp32 (what mixed_precision=auto picks on a CPU without native bf16):
    the grouped experts trace (torch._grouped_mm's meta kernel takes bf16 only, so fp32 runs the
    per-expert products) and loss and gradients equal eager's; DeepSeek-V3's latent attention and
    group-limited routing too."""
    args = dataclasses.replace(PRESETS[preset], dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=512,
                               moe_hidden_dim=32, n_experts=4, max_seq_len=256,
                               **({"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                   "qk_rope_head_dim": 4, "v_head_dim": 6, "moe_n_groups": 2,
                                   "moe_topk_groups": 1} if preset == "deepseek-debug" else {}))
    models = [build_model(args, device="cpu") for _ in range(2)]
    for m in models:
        init_weights(m, 0)
    apply_compile(models[1], True)
    tokens = TOKENS[:2, :64] % args.vocab_size
    losses = []
    for m in models:
        loss = torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("loss_chunk", [0, 256], ids=["plain-loss", "fused-loss"])
def test_the_compiled_step_has_no_graph_breaks(one_rank_group: None, loss_chunk: int):
    """The trainer's compiled path -- blocks under FSDP in bf16, then the plain loss or the fused
    loss's softmax pass -- compiles without one graph break: one graph for every block (they share
    it) and one for the loss, and a second step compiles nothing new."""
    from torch._dynamo.utils import counters

    from shardwise.config.schema import Config
    from shardwise.data.dataset import Batch
    from shardwise.parallel.dims import ParallelDims
    from shardwise.parallel.parallelize import parallelize
    from shardwise.trainer.loss import TokenLoss

    torch._dynamo.reset()
    counters.clear()
    cfg = Config()
    cfg.training.mixed_precision = "bf16"
    dims = ParallelDims.from_config(cfg.parallel, 1)
    dims.build_mesh("cpu")
    m = build_model(ARGS)
    parallelize(m, dims, cfg, compiled=True)
    m.to_empty(device="cpu")
    init_weights(m, 0)
    loss = TokenLoss(loss_chunk, compiled=True)
    batch = Batch(TOKENS, TOKENS.roll(-1, 1), None, TOKENS.numel())
    for _ in range(2):
        loss(m, batch, backward_over=torch.tensor(TOKENS.numel()))
        if _ == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert graphs == counters["stats"]["unique_graphs"] == 2  # the blocks' graph and the loss's
