"""The planner against the real thing, in one process: states from shapes equal the real model
parallelized on torch's fake process group; activations per op equal the tensors autograd saves;
the step-memory timeline is within 3% of torch's MemTracker peak; per-rank FLOPs add up to the
executed FLOPs; plan returns layouts the trainer accepts."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from shardwise.config.schema import ConfigError
from shardwise.data.dataset import Batch
from shardwise.models import model_args
from shardwise.models.transformer import build_model
from shardwise.observe.flops import attention_pairs, executed_flops
from shardwise.observe.memory import SavedActivations
from shardwise.optim.adamw import build_optimizer
from shardwise.parallel import fsdp
from shardwise.parallel.stages import PipelineShape
from shardwise.plan import search as plan_search
from shardwise.plan import states
from shardwise.plan.activations import activations
from shardwise.plan.comm import group_members
from shardwise.plan.cost import rank_time
from shardwise.plan.hardware import available, load_hardware
from shardwise.plan.layout import Layout
from shardwise.plan.memory import Timeline, memory_floor, one_pass, repeat, step_memory, then
from shardwise.plan.schedule import in_flight, schedule_actions
from shardwise.plan.search import enumerate_layouts, layout_refusal, parse_tokens, plan, plan_config
from shardwise.plan.states import build_rank, built_states, fake_world, shape_states
from shardwise.resolve.checks import load_config
from shardwise.resolve.run import resolve_run
from shardwise.trainer.build import build_rank_model
from shardwise.trainer.loss import TokenLoss
from tests.helpers import ROOT, one_rank_pg, planned, resolved_config

DEBUG, MOE = str(ROOT / "configs" / "debug.toml"), str(ROOT / "configs" / "moe-debug.toml")
DEEPSEEK = str(ROOT / "configs" / "deepseek-debug.toml")

# (config, world, overrides): every parallelism, uneven FSDP chunks, every pipeline placement.
LAYOUTS = [
    (DEBUG, 1, []),
    (DEBUG, 3, ["--parallel.dp_shard=3", "--training.global_batch=6", "--model.vocab_size=2050"]),
    (DEBUG, 8, ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.dp_replicate=2"]),
    (DEBUG, 8, ["--parallel.dp_shard=2", "--parallel.cp=2", "--parallel.tp=2"]),
    (DEBUG, 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--training.micro_batch=2"]),
    (DEBUG, 2, ["--parallel.pp=2", "--parallel.pp_schedule=zbv", "--training.micro_batch=1"]),
    (DEBUG, 2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b",
                "--parallel.pp_stages_per_rank=3", "--training.micro_batch=1"]),
    (DEBUG, 4, ["--parallel.dp_shard=4", "--parallel.reshard_after_forward=never",
                "--optimizer.state_dtype=bf16"]),
    (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2"]),
    (MOE, 8, ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.ep=4", "--parallel.dp_replicate=2"]),
    # latent attention: compressions whole on every tp rank, expansions split by heads
    (DEEPSEEK, 8, ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.ep=4", "--parallel.pp=2",
                   "--training.micro_batch=1"]),
    (DEBUG, 256, ["--model.name=70b", "--parallel.dp_shard=32", "--parallel.tp=8", "--training.seq_len=8192",
                  "--training.global_batch=512", "--training.micro_batch=1"]),
]


@pytest.fixture
def gpu_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP units as on a GPU: a one-rank mesh wraps the model as one unit (parallel/fsdp.py
    one_unit), here on the CPU so the trainer's and the planner's one-unit paths run in make test."""
    monkeypatch.setattr(fsdp, "ONE_UNIT_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("path,world,overrides", LAYOUTS)
def test_shape_states_equal_the_built_model(path: str, world: int, overrides: list[str]):
    """Per pipeline rank: parameter, gradient and optimizer bytes, and every FSDP unit (padded size,
    shard group, replicas, reshard) -- from shapes exactly as from the real parallelized model."""
    cfg = load_config(path, overrides)
    run = planned(cfg, world)
    built = built_states(run)
    shaped = shape_states(run)
    assert len(built) == len(shaped) == run.dims.pp
    for b, s in zip(built, shaped, strict=True):
        assert (b.params, b.grads, b.optimizer) == (s.params, s.grads, s.optimizer)
        assert (b.layers, b.has_embedding, b.has_head) == (s.layers, s.has_embedding, s.has_head)
        assert sorted(b.units, key=str) == sorted(s.units, key=str)
        assert b.params > 0


@pytest.mark.parametrize("path,world,overrides", [
    (DEBUG, 1, []), (DEBUG, 2, ["--parallel.tp=2"]), (MOE, 1, []),
    (MOE, 2, ["--parallel.tp=2", "--parallel.ep=2"]),  # the MoE feed-forward's mesh spans the tp ranks
    (DEBUG, 2, ["--parallel.dp_shard=2"])])  # data parallel: per-block units as before
def test_one_unit_states_equal_the_built_model(gpu_units: None, path: str, world: int, overrides: list[str]):
    cfg = load_config(path, overrides)
    built, shaped = built_states(planned(cfg, world)), shape_states(planned(cfg, world))
    for b, s in zip(built, shaped, strict=True):
        assert (b.params, b.grads, b.optimizer) == (s.params, s.grads, s.optimizer)
        assert sorted(b.units, key=str) == sorted(s.units, key=str)
    (root,) = [u for u in built[0].units if u.layer is None]
    blocks = [u for u in built[0].units if u.layer is not None and u.group == "dp_shard_cp"]
    n_layers = model_args(cfg.model).n_layers
    if "--parallel.dp_shard=2" in overrides:  # data parallel: per-block units
        assert not root.blocks and len(blocks) == n_layers
    else:  # the root holds every block; only a feed-forward on a wider mesh stays a unit of its own
        assert not blocks and [i for i, _ in root.blocks] == list(range(n_layers))
        assert len(built[0].units) == 1 or "--parallel.ep=2" in overrides


@pytest.mark.parametrize("path", [DEBUG, MOE])
def test_plain_states_equal_the_built_model(path: str):
    """parallel.one_rank = plain (no FSDP): no unit, and each block's elements and the rest's, whose
    gradients the timeline brings in at each part's backward -- from shapes exactly as from the built
    model."""
    cfg = load_config(path, ["--parallel.one_rank=plain"])
    built, shaped = built_states(planned(cfg, 1)), shape_states(planned(cfg, 1))
    assert built == shaped
    (st,) = built
    assert st.units == () and [i for i, _ in st.plain] == [*range(model_args(cfg.model).n_layers), None]
    assert 4 * sum(n for _, n in st.plain) == st.params == st.grads
    fsdp = load_config(path, ["--parallel.one_rank=fsdp"])
    assert shape_states(planned(fsdp, 1))[0].plain == ()


@pytest.mark.parametrize("path,world,overrides,one", [
    (DEBUG, 4, ["--parallel.dp_shard=2", "--parallel.tp=2"], False),
    (DEBUG, 4, ["--parallel.dp_shard=4", "--parallel.reshard_after_forward=always"], False),
    (DEBUG, 2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b", "--model.n_layers=12",
                "--parallel.pp_stages_per_rank=3", "--training.micro_batch=1"], False),
    (DEBUG, 4, ["--parallel.pp=4", "--model.n_layers=13", "--training.micro_batch=1"], False),
    (DEBUG, 4, ["--parallel.pp=4", "--parallel.pp_schedule=zbv", "--model.n_layers=16",
                "--training.micro_batch=1"], False),
    (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2"], False),
    (MOE, 5, ["--parallel.pp=5", "--model.n_layers=25", "--model.n_dense_layers=6",  # rank 1 has one dense
              "--training.micro_batch=1"], False),
    (DEBUG, 1, [], True),  # one unit: the root holds every block
    (MOE, 2, ["--parallel.tp=2", "--parallel.ep=2"], True)])
def test_alike_blocks_built_once_count_as_every_block(monkeypatch: pytest.MonkeyPatch,
                                                      request: pytest.FixtureRequest, path: str, world: int,
                                                      overrides: list[str], one: bool):
    """plan's exact estimate builds each kind of block once per rank, and pipeline ranks of the
    same make once: the states, the FSDP units (names, sizes, order) and the layers of every rank
    equal those of building every block of every rank."""
    if one:
        request.getfixturevalue("gpu_units")
    cfg = load_config(path, overrides)
    builds = []
    monkeypatch.setattr(states, "build_rank", lambda *a: builds.append(a) or build_rank(*a))
    run = planned(cfg, world)
    alike = built_states(run)
    once = len(builds)
    assert alike == built_states(run, every_block=True)
    pp = run.dims.pp
    assert len(builds) - once == pp
    if pp >= 4:  # these have middle ranks of the same make: built once
        assert once < pp
    with fake_world(world, 0):  # and blocks were in fact dropped
        model, _ = build_rank(run, every_block=False)
    assert model.alike and sorted([*map(int, model.layers), *model.alike]) == list(alike[0].layers)


def test_states_count_local_shards():
    """FSDP over 4 ranks: each rank holds a quarter of every parameter (dims divide evenly here)."""
    cfg = load_config(DEBUG, ["--parallel.dp_shard=4"])
    full = sum(p.numel() for p in build_model(model_args(cfg.model)).parameters())
    st = built_states(planned(cfg, 4))[0]
    assert st.params == st.grads == 4 * full // 4
    assert st.optimizer == 8 * full // 4  # two fp32 moments


@pytest.fixture
def one_rank():
    """Per test, not per module: plan() refuses to run beside a live process group."""
    with one_rank_pg():
        yield


def _trainer_model(cfg):
    """The model exactly as the trainer builds it on one rank."""
    run = resolve_run(cfg, 1)
    run.dims.build_mesh("cpu")
    return build_rank_model(run, "cpu")


def _batch(cfg, n: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    v, s = cfg.model.vocab_size, cfg.training.seq_len
    tokens, labels = (torch.randint(0, v, (n, s), generator=g) for _ in range(2))
    # Two documents of unaligned lengths: the per-document attention saves what causal attention does.
    doc_ids = (torch.arange(s) >= s // 3).long().expand(n, s) if cfg.data.document_mask else None
    return Batch(tokens, labels, doc_ids, n * s)


# (eager, whatever compile.enabled=auto decides: the formulas are exact for the eager ops)
SMALL = ["--training.global_batch=2", "--training.seq_len=256", "--compile.enabled=false"]


@pytest.mark.parametrize("path,overrides", [
    (DEBUG, ["--training.mixed_precision=bf16"]),  # (pinned: `auto` is fp32 on an AVX2 host)
    (DEBUG, ["--training.mixed_precision=fp32"]),
    (DEBUG, ["--model.n_kv_heads=4"]),
    (DEBUG, ["--model.qk_norm=true", "--model.n_kv_heads=4", "--training.mixed_precision=bf16"]),
    (DEBUG, ["--model.qk_norm=true", "--training.mixed_precision=fp32"]),
    (DEBUG, ["--training.loss_chunk=128"]),
    (DEBUG, ["--activation_checkpoint.mode=full"]),
    (DEBUG, ["--activation_checkpoint.mode=layer", "--activation_checkpoint.every=3"]),
    (DEBUG, ["--data.document_mask=true", "--training.mixed_precision=fp32"]),
    (MOE, []),
    (MOE, ["--model.moe_hidden_dim=128", "--model.n_shared_experts=2", "--model.moe_score=sigmoid"]),
    (MOE, ["--model.moe_balance=bias", "--model.moe_route_norm=false"]),
    (MOE, ["--model.moe_z_coef=1e-3", "--training.mixed_precision=fp32"]),
    (DEEPSEEK, ["--training.mixed_precision=bf16"]),
    (DEEPSEEK, ["--training.mixed_precision=fp32"]),
    (DEEPSEEK, ["--model.q_lora_rank=0", "--model.v_head_dim=48", "--training.mixed_precision=fp32"]),
    (DEEPSEEK, ["--activation_checkpoint.mode=full", "--training.mixed_precision=bf16"]),
])
def test_activations_equal_saved_tensors(one_rank, path: str, overrides: list[str],
                                        monkeypatch: pytest.MonkeyPatch):
    """The per-op formulas give exactly the bytes autograd saves for backward (unique storages).
    MoE experts on CPU pad their groups by what routing gave each: the formulas are checked with
    the rows the run really padded to, and the planner's expectation of them (half an alignment
    per expert) against those rows."""
    import shardwise.models.moe as moe
    from shardwise.plan import activations as acts

    padded_rows = []
    pad_groups = moe.pad_groups

    def recorded(x: torch.Tensor, counts: torch.Tensor, align: int):
        out = pad_groups(x, counts, align)
        padded_rows.append(int(out[1].sum()))
        return out
    monkeypatch.setattr(moe, "pad_groups", recorded)
    cfg = load_config(path, SMALL + overrides)
    model = _trainer_model(cfg)
    with SavedActivations() as saved:
        TokenLoss(resolve_run(cfg, 1).loss_chunk)(model, _batch(cfg, 2), torch.tensor(512))
    run = planned(cfg, 1)
    st = shape_states(run)[0]
    if padded_rows:  # one call per MoE block
        shape = acts.shape_of(run)
        mean = sum(padded_rows) / len(padded_rows)
        assert abs(acts.expert_rows(shape) / mean - 1) < 0.05, (acts.expert_rows(shape), padded_rows)
        monkeypatch.setattr(acts, "expert_rows", lambda s: mean)
    predicted = sum(activations(run, st.layers, st.has_embedding, st.has_head).values())
    assert predicted == pytest.approx(saved.bytes, abs=len(padded_rows))  # (a mean of the blocks' rows)


PEAK_CASES = [[], ["--activation_checkpoint.mode=full"], ["--activation_checkpoint.mode=selective"],
              ["--activation_checkpoint.mode=selective_half"], ["--training.loss_chunk=128"],
              ["--training.micro_batch=1"],
              # loss-dominated: the plain loss drops the bf16 logits before backward
              ["--training.loss=plain", "--model.vocab_size=32768"]]
BF16, FP32 = "--training.mixed_precision=bf16", "--training.mixed_precision=fp32"


# bf16 in both unit layouts and without FSDP (plain: autocast, eager so its weight copies are saved);
# fp32 (what `auto` picks on a CPU without native bf16) with the CPU's per-block units. Not in the
# list, as docs/planning.md's limits say: fp32 with micro-batch 1 is +3.4% and fp32 with one unit on
# one rank +14..+17% (the timeline keeps an unsharded fp32 copy of the model at the root's reduce
# that MemTracker does not see at world size 1).
# The extended set (make test-all) has every case in bf16 with the three layouts; CI keeps the
# defaults in both precisions and the three layouts, each memory switch in fp32 with the per-block
# units, and the loss-dominated case (bf16 logits) in bf16.
@pytest.mark.parametrize("units,overrides", [(units, [BF16, *case]) for units in ("per-block", "one", "plain")
                                             for case in PEAK_CASES if not case]
                         + [("per-block", [BF16, *PEAK_CASES[-1]])]
                         + [pytest.param(units, [BF16, *case], marks=pytest.mark.slow)
                            for units in ("per-block", "one", "plain") for case in PEAK_CASES[1:]
                            if (units, case) != ("per-block", PEAK_CASES[-1])]
                         + [("per-block", [FP32, *case]) for case in PEAK_CASES[:5]])
def test_peak_matches_memtracker(one_rank, units: str, overrides: list[str], monkeypatch: pytest.MonkeyPatch):
    """The timeline's peak of a steady-state step (optimizer states allocated) is within 3% (6% for
    full checkpointing) of torch's MemTracker peak of live tensors for the same step; with the
    CPU's per-block FSDP units, with a GPU's one unit (parallel/fsdp.py one_unit) and without FSDP
    (parallel.one_rank = plain)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if units == "one":
        monkeypatch.setattr(fsdp, "ONE_UNIT_DEVICES", ("cuda", "cpu"))
    elif units == "plain":  # no FSDP (parallel.one_rank, a GPU's default): fp32 parameters, autocast
        overrides = [*overrides, "--parallel.one_rank=plain"]

    from shardwise.observe.memory import _StepMemTracker

    cfg = load_config(DEBUG, SMALL + overrides)
    model = _trainer_model(cfg)
    opt = build_optimizer(model, cfg.optimizer, "cpu")
    mb = cfg.training.micro_batch or 2
    batch = _batch(cfg, 2)

    def step() -> None:
        for i in range(0, 2, mb):
            part = Batch(batch.inputs[i:i + mb], batch.labels[i:i + mb], None, mb * 256)
            TokenLoss(resolve_run(cfg, 1).loss_chunk)(model, part, torch.tensor(512))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for p in model.parameters():  # the optimizer's states, allocated as a first step would
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = _StepMemTracker() if mb < 2 else MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    run = planned(cfg, 1)
    predicted = step_memory(run, shape_states(run)[0]).peak
    # Full checkpointing's peak sits inside a recomputed block's backward, whose gradient
    # temporaries are modelled per sub-layer only: looser there (the issue asks for 10%).
    tol = 0.06 if "full" in " ".join(overrides) else 0.03
    assert abs(predicted / measured - 1) < tol, (predicted, measured)


def test_rank_flops_add_up_to_executed_flops():
    """Split over tp x pp, the ranks' FLOPs sum to the step's executed FLOPs (flops.py), with
    recompute and the chunked loss."""
    hw = load_hardware("h100")
    for extra in ([], ["--activation_checkpoint.mode=full", "--training.loss_chunk=256"]):
        cfg = load_config(DEBUG, ["--parallel.tp=2", "--parallel.pp=2", "--training.micro_batch=2", *extra])
        if cfg.training.loss_chunk:
            cfg.parallel.pp = 1
            cfg.parallel.dp_shard = 2
        run = planned(cfg, 4)
        ranks = [rank_time(run, st, hw) for st in shape_states(run)]
        t, d = cfg.training, run.dims
        tokens_per_share = t.global_batch * t.seq_len // d.dp
        step = executed_flops(model_args(cfg.model), tokens_per_share,
                              t.global_batch // d.dp * attention_pairs(t.seq_len),
                              cfg.activation_checkpoint.mode, chunked_loss=t.loss_chunk > 0).total
        assert sum(r.flops for r in ranks) * d.tp * d.cp == pytest.approx(step, rel=1e-9)


def test_pipeline_in_flight():
    """1F1B holds pp - rank micro-batches (Narayanan et al.), GPipe all of them."""
    one = PipelineShape(4, "1f1b")
    assert [in_flight(one, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(one._replace(schedule="gpipe"), 8, 0) == 8
    assert [k for k, _ in schedule_actions(one, 8, 0)[:5]] == ["F", "F", "F", "F", "B"]
    assert [k for k, _ in schedule_actions(one, 8, 3)[:3]] == ["F", "B", "F"]
    # torch's own orders for the multi-stage schedules: every pass of every local stage once
    for sched, stages in (("interleaved1f1b", {0, 4}), ("zbv", {0, 7}), ("dualpipev", {0, 7})):
        order = schedule_actions(one._replace(schedule=sched), 8, 0)
        assert {x for _, x in order} == stages
        assert sum(k == "F" for k, _ in order) == 16
        assert sum(k in ("B", "I") for k, _ in order) == 16


def test_group_members():
    """Rank layout pp, dp_replicate, dp_shard, cp, tp (outermost first); ep innermost of
    dp_shard x cp x tp."""
    lay = Layout(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2, ep=2).degrees
    assert group_members(lay, "tp") == {0, 1}
    assert group_members(lay, "dp_shard") == {0, 2}
    assert group_members(lay, "dp_replicate") == {0, 4}
    assert group_members(lay, "dp_cp_tp") == {0, 1, 2, 3, 4, 5, 6, 7}
    assert group_members(lay, "pp") == {0, 8}
    assert group_members(lay, "ep") == {0, 1} and group_members(lay, "efsdp") == {0, 2}
    assert group_members(lay, "tp", pp_rank=1) == {8, 9}


def test_layout_round_trip():
    cfg = load_config(DEBUG, ["--parallel.tp=2", "--parallel.pp=2", "--training.micro_batch=2",
                              "--activation_checkpoint.mode=selective"])
    run = planned(cfg, 8)
    lay = Layout.of(run)
    assert (lay.dp_shard, lay.world, run.micro_batches) == (2, 8, 2)
    assert Layout.of(lay.resolve(load_config(DEBUG))) == lay
    assert str(lay) == "pp2 dp_shard2 tp2 1f1b mb2 ac=selective"
    assert len({lay, Layout.of(planned(cfg, 8))}) == 1


def test_hardware_profiles_load():
    for name in available():
        if name == "local":
            continue
        hw = load_hardware(name)
        assert hw.peak_tflops["bf16"] > 0 and hw.memory_gib > 0 and hw.gpus_per_node == 8, name
        assert hw.link(8)[0] > hw.link(16)[0]  # NVLink / fabric inside a node beats the network
    with pytest.raises(ConfigError, match="unknown hardware 'h1000'"):
        load_hardware("h1000")
    with pytest.raises(ConfigError, match="shardwise calibrate"):
        load_hardware("local", cache_dir="/nonexistent")
    with pytest.raises(ConfigError, match="no fp8 peak"):
        load_hardware("a100").matmul_tflops("fp8", 4096)


def test_plan_returns_layouts_the_trainer_accepts():
    """8B on 8 H100: the ranked layouts pass the trainer's own layout checks, fit, are sorted, and
    the top ones are estimated exactly."""
    from shardwise.resolve.run import resolve_run

    cfg = plan_config(resolved_config(None, ["--model.name=8b"], device="cuda"), 8192, parse_tokens("128K"))
    assert cfg.training.global_batch == 16
    hw = load_hardware("h100")
    result = plan(cfg, 8, hw, top=2, schedules=("1f1b",))
    assert result.ranked and result.dropped["memory over capacity"] > 0
    speeds = [c.tokens_per_s_per_device for c in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    for c in result.ranked[:20]:
        resolve_run(c.layout.apply(cfg), 8, detect_device=False)  # (planned for GPUs, checked here)
        assert c.peak <= 0.9 * hw.memory_gib * 2**30
    assert [e.layout for e in result.top] == [c.layout for c in result.ranked[:2]]
    assert result.top[0].peak == result.ranked[0].peak  # exact states agree with the shape path


class _Cycle:
    """An object in a reference cycle that records which process finalizes it."""

    def __init__(self, log: Path) -> None:
        self.log, self.me = log, self

    def __del__(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


_REAL_SEARCH = plan_search._search
_THREADS_LOG: list[Path] = []  # set before the workers fork: they inherit it


def _collecting_search(*args: object) -> object:
    """The search, after a full collection and a note of the worker's thread count."""
    gc.collect()
    with open(_THREADS_LOG[0], "a") as f:
        f.write(f"{torch.get_num_threads()}\n")
    return _REAL_SEARCH(*args)


def test_forked_search_workers_leave_the_callers_garbage_alone(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    """The search's forked workers must not finalize what their caller left for its garbage collector
    (in a test runner or after a run, process groups whose destructors wait on threads a child lacks:
    it hangs or crashes), and compute on one thread. Planted: cycles that become garbage in the
    oldest generation, and a full collection in each worker; only the caller may finalize them."""
    log = tmp_path / "finalized"
    monkeypatch.setattr(plan_search, "_search", _collecting_search)
    monkeypatch.setattr(sys.modules[__name__], "_THREADS_LOG", [tmp_path / "threads"])
    planted = [_Cycle(log) for _ in range(50)]
    gc.collect()  # the cycles, reachable, now sit in the oldest generation
    del planted  # garbage a young collection does not reach
    cfg = plan_config(resolved_config(None, ["--model.name=8b"], device="cuda"), 8192, parse_tokens("128K"))
    result = plan(cfg, 8, load_hardware("h100"), top=0, schedules=("1f1b",), workers=2)
    assert result.ranked
    assert log.read_text().split() == [str(os.getpid())] * 50
    assert set((tmp_path / "threads").read_text().split()) == {"1"}


def test_plan_skips_only_dominated_checkpointing_modes():
    """Of one layout's checkpointing modes that fit, the search costs the fastest only: the best
    layout and its speed are those of costing every fitting layout, and each skipped one is slower
    than the one kept for its layout."""
    from shardwise.plan.cost import step_time
    from shardwise.plan.memory import step_memory
    from shardwise.plan.search import param_shapes

    cfg = plan_config(resolved_config(None, ["--model.name=8b"], device="cuda"), 8192, parse_tokens("128K"))
    hw = load_hardware("h100")
    result = plan(cfg, 8, hw, top=0, schedules=("1f1b",), workers=1)
    assert result.dropped["slower than a checkpointing mode that fits"] > 0
    # searched by two forked workers, chunk by chunk: the same answer, in the same order
    two = plan(cfg, 8, hw, top=0, schedules=("1f1b",), workers=2)
    assert (two.ranked, two.dropped, two.refusals, two.least) == (result.ranked, result.dropped,
                                                                  result.refusals, result.least)
    shapes, every = param_shapes(model_args(cfg.model)), {}
    for layout in enumerate_layouts(model_args(cfg.model), 8, hw, schedules=("1f1b",)):
        if layout_refusal(cfg, layout):
            continue
        run = layout.resolve(cfg)
        states = shape_states(run, shapes)
        if max(hw.reserved(step_memory(run, st).peak) for st in states) <= 0.9 * hw.memory_gib * 2**30:
            every[layout] = step_time(run, states, hw).tokens_per_s / 8
    best = max(every, key=every.get)
    assert result.ranked[0].layout == best and result.ranked[0].tokens_per_s_per_device == every[best]
    kept = {dataclasses.replace(c.layout, ac="none"): c.tokens_per_s_per_device for c in result.ranked}
    assert len(every) == len(result.ranked) + result.dropped["slower than a checkpointing mode that fits"]
    assert all(speed <= kept[dataclasses.replace(layout, ac="none")] for layout, speed in every.items())


@pytest.mark.parametrize("path", [DEBUG, MOE])
def test_layout_checks_do_not_depend_on_the_checkpointing_mode(path: str):
    """The search asks the trainer's checks once per group of layouts that differ only in their
    checkpointing mode: every mode of a group gets the same verdict (refusals included)."""
    cfg = load_config(path, ["--training.global_batch=16"])
    modes = ("none", "selective", "full", "layer")
    layouts = enumerate_layouts(model_args(cfg.model), 8, load_hardware("h100"), ac_modes=modes)
    verdicts: dict = {}
    for layout in layouts:
        verdicts.setdefault(dataclasses.replace(layout, ac="none"), set()).add(layout_refusal(cfg, layout))
    assert all(len(v) == 1 for v in verdicts.values())
    assert any(v != {""} for v in verdicts.values()) and any(v == {""} for v in verdicts.values())


def test_folded_passes_replay_as_their_events_do():
    """A pipeline stage's backward is applied as one folded pass (one_pass, repeat, then): over
    random sequences of allocations and frees, the peak, where it happens and its parts equal
    applying every event one by one (ties keep the first high point)."""
    rng = random.Random(0)
    parts = ["activations", "grads", "loss", "recompute"]
    for _ in range(300):
        steps = [([(rng.choice(parts), rng.randint(-5, 5)) for _ in range(rng.randint(1, 5))],
                  rng.randint(0, 3), f"step {k}") for k in range(rng.randint(1, 6))]
        live, peak, where, at, now = 0, 0, "", {}, {}  # the reference: event by event
        for events, times, name in steps:
            for _ in range(times):
                for part, n in events:
                    live += n
                    now[part] = now.get(part, 0) + n
                    if live > peak:
                        peak, where, at = live, name, dict(now)
        one_by_one = Timeline()
        for events, times, name in steps:
            one_by_one.run(events, times, name)
        folded, grouped = Timeline(), None
        for events, times, _ in steps:
            grouped = then(grouped, repeat(one_pass(events), times))
        folded.apply(grouped, "all")
        assert (one_by_one.peak, one_by_one.where) == (peak, where)
        assert folded.peak == peak and (folded.where == "all") == (peak > 0)
        for tl in (one_by_one, folded):
            assert {k: v for k, v in tl.peak_parts.items() if v} == {k: v for k, v in at.items() if v}


def test_plan_with_float8_checks_layouts_without_building_the_model(monkeypatch: pytest.MonkeyPatch, capsys):
    """The trainer's per-run float8 summary (which builds the model on meta) stays out of the layout
    checks the planner runs on every candidate: a 405B search would otherwise take tens of minutes."""
    import shardwise.resolve.preflight as preflight

    calls = []
    monkeypatch.setattr(preflight, "float8_summary", lambda *a: calls.append(a) or "")
    base = resolved_config(None, ["--model.name=8b", "--float8.enabled=true"], device="cuda")
    cfg = plan_config(base, 8192, parse_tokens("128K"))
    result = plan(cfg, 8, load_hardware("h100"), top=1, schedules=("1f1b",))
    assert result.ranked and result.considered > 50 and not calls
    assert "float8" not in capsys.readouterr().out


@pytest.mark.parametrize("path, world, overrides", [
    (DEBUG, 8, ["--training.global_batch=16"]),
    (MOE, 8, ["--training.global_batch=16"]),
    (DEBUG, 32, ["--model.name=8b", "--training.seq_len=4096", "--training.global_batch=64"]),
])
def test_memory_floor_never_exceeds_the_peak(path: str, world: int, overrides: list[str]):
    """The planner drops a layout whose memory floor is over capacity without replaying its step:
    over every accepted candidate of a search (every schedule, micro-batch and checkpointing mode,
    pipeline ranks first and last), the floor is at most the replayed peak -- and not a trivial
    bound (over half the peak on average)."""
    cfg = load_config(path, overrides)
    ratios = []
    for layout in enumerate_layouts(model_args(cfg.model), world, load_hardware("h100"), max_micro_batch=2):
        if layout_refusal(cfg, layout):
            continue
        run = layout.resolve(cfg)
        for st in shape_states(run):
            floor, peak = memory_floor(run, st), step_memory(run, st).peak
            assert floor <= peak, (str(layout), st.pp_rank, floor, peak)
            ratios.append(floor / peak)
    assert len(ratios) > 50 and sum(ratios) / len(ratios) > 0.5


def test_estimate_resolves_the_run_as_train_does():
    """pp=2 without a micro-batch: the trainer picks one (4 micro-batches per rank here), and so
    does the estimate -- it once costed the whole per-rank batch as one micro-batch."""
    from shardwise.plan.estimate import estimate

    cfg = load_config(DEBUG, ["--parallel.pp=2", "--parallel.dp_shard=2"])
    est = estimate(cfg, 4, load_hardware("h100"), exact=False)
    assert est.layout.micro_batch == 1 and est.cfg.training.micro_batch == 1
    assert est.run.micro_batches == 4
    assert cfg.training.micro_batch == 0  # (the caller's config, unchanged)


def test_parse_tokens():
    assert parse_tokens("4M") == 4 * 2**20 and parse_tokens("512k") == 2**19 and parse_tokens("1000") == 1000
    with pytest.raises(ConfigError, match="global-batch-tokens"):
        parse_tokens("lots")


def test_reserved_over_live_is_the_8b_fit_and_predicts_the_rest():
    """The allocator's reserved-over-live factor shipped is what ``bench/published.py --fit`` finds
    on torchtitan's published 8B rows (a memory-model change that moves it asks for the refit),
    and with it every published row's memory -- the 70B and 405B ones outside the fit -- is within
    10% of the published reserved peak, as docs/planning.md states."""
    import sys

    from shardwise.plan.estimate import GiB, estimate
    from shardwise.plan.hardware import RESERVED_OVER_LIVE

    sys.path.insert(0, str(ROOT / "bench"))
    import published

    hw = load_hardware("h100-gt")
    rows = [(row[0], estimate(published.config(*row[1:10]), row[2], hw, exact=False), row[11])
            for row in published.ROWS]
    assert published.fit_reserved([r for r, row in zip(rows, published.ROWS, strict=True)
                                   if row[1] == "8b"]) == RESERVED_OVER_LIVE
    errors = {label: est.reserved / GiB / gib - 1 for label, est, gib in rows}
    assert all(abs(e) < 0.10 for e in errors.values()), errors
    assert load_hardware("h100").reserved(GiB) == RESERVED_OVER_LIVE * GiB
    # no caching allocator on local CPU ranks
    assert dataclasses.replace(load_hardware("h100"), cores=2).reserved(GiB) == GiB


def test_cuda_ranks_expand_allocator_segments_unless_configured(monkeypatch: pytest.MonkeyPatch):
    """CUDA ranks run the caching allocator as the runs the reserved factor was fitted to
    (expandable segments); an allocator setting of the user's, under either name, is kept."""
    import os

    from shardwise.runtime.machine import CUDA_ALLOC_ENV, expandable_cuda_segments

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert not expandable_cuda_segments() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    for name in CUDA_ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    assert expandable_cuda_segments() and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# One-GPU rows this project measured (BENCHMARKS.md: `bench/throughput.py --device cuda`, the
# trainer's defaults -- compiled blocks, fused loss): profile, preset, sequences x length per step,
# measured tokens/s of each run. H100 SXM 80GB 2026-11-24 and 2026-11-26, H200 2026-11-26: all with
# FSDP on the one rank (before parallel.one_rank; the one-GPU default's rows: test_plan_gpu.py).
OWN_GPU_ROWS = [("h100", "125m", 8, 2048, (361_866, 347_044, 378_892)),
                ("h100", "125m", 2, 8192, (274_835, 259_057)),
                ("h100", "1b", 4, 2048, (52_881, 53_703, 53_345, 53_688, 53_176)),
                ("h100", "1b", 1, 8192, (45_387, 45_217, 45_761)),
                ("h200", "125m", 8, 2048, (384_013, 401_428)),
                ("h200", "1b", 4, 2048, (57_616,))]


@pytest.mark.parametrize("hardware,preset,batch,seq,measured", OWN_GPU_ROWS)
def test_the_gpu_profiles_predict_our_own_gpu_rows(hardware: str, preset: str, batch: int, seq: int,
                                                   measured: tuple):
    """The ``h100`` and ``h200`` profiles -- data-sheet peaks and GEMM efficiency; their host time
    per op and attention by shape measured on those machines, nothing fitted to these runs --
    predict the tokens/s of every measured run within 15% (docs/planning.md: -7% to +12%; one shape
    measured twice on two H100 machines differed by 6%). The 125m
    rows at 2,048 tokens wait on the host: without the host term each is predicted at least 4%
    faster (H100) and 15% (H200)."""
    from shardwise.plan.estimate import estimate
    from shardwise.resolve.run import compile_run

    cfg = resolved_config(None, [f"--model.name={preset}", f"--training.global_batch={batch}",
                             f"--training.seq_len={seq}", f"--model.max_seq_len={max(seq, 2048)}",
                             "--training.steps=100000", "--run.device=cuda", "--parallel.one_rank=fsdp"],
                      device="cuda")
    hw = load_hardware(hardware)
    est = estimate(cfg, 1, hw, exact=False)
    assert est.layout.world == 1 and compile_run(cfg, est.layout, "cuda", toolchain=False)[0]  # as measured
    for tokens_per_s in measured:
        assert abs(est.time.tokens_per_s / tokens_per_s - 1) < 0.15, (est.time.tokens_per_s, tokens_per_s)
    if preset == "125m" and seq == 2048:  # the host term is what brings these in
        no_host = estimate(cfg, 1, dataclasses.replace(hw, host_us_per_op=0.0), exact=False)
        assert no_host.time.tokens_per_s / est.time.tokens_per_s > (1.04 if hardware == "h100" else 1.15)


@pytest.mark.parametrize("overrides", [
    ["--parallel.pp=32", "--parallel.pp_schedule=1f1b", "--parallel.tp=2", "--parallel.ep=8",
     "--training.micro_batch=1"],
    ["--parallel.pp=16", "--parallel.pp_schedule=interleaved1f1b", "--parallel.pp_stages_per_rank=2",
     "--parallel.ep=8", "--training.micro_batch=1"],
])
def test_search_ranks_bound_every_pipeline_rank(overrides: list[str]):
    """The pipeline ranks the search costs (the first of each kind of stage, and the last) hold
    the largest peak and the longest step of all ranks -- DeepSeek-V3's three dense blocks make the
    first stage lighter than the ones after it, so the first and last alone would miss the peak."""
    from shardwise.plan.cost import step_time

    cfg = resolved_config(str(ROOT / "configs" / "deepseek-v3-671b.toml"), overrides, device="cuda")
    run, hw = planned(cfg, 512), load_hardware("h100")
    every = shape_states(run)
    bounding = states.bounding_pp_ranks(run)
    assert len(bounding) > 2
    peak = lambda sts: max(step_memory(run, st).peak for st in sts)  # noqa: E731
    assert peak(every[r] for r in bounding) == peak(every)
    assert peak(every[r] for r in (0, len(every) - 1)) < peak(every)  # the ends alone fall short
    assert step_time(run, [every[r] for r in bounding], hw).step == pytest.approx(
        step_time(run, every, hw).step, rel=1e-6)
