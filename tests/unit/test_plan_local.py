"""The planner on a measured machine (``--hardware local``): the lookups of a calibrated profile
(collectives per kind and size, attention per sequence, GEMMs per row count, memory bandwidth by
tensor size and allocator) and what sharing fewer cores does to a pipeline's step."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.config.schema import ConfigError
from shardwise.models import model_args
from shardwise.plan.hardware import load_hardware
from shardwise.plan.layout import Layout
from shardwise.plan.states import shape_states
from shardwise.resolve.checks import load_config
from tests.helpers import ROOT, planned, resolved_config

DEBUG, MOE = str(ROOT / "configs" / "debug.toml"), str(ROOT / "configs" / "moe-debug.toml")


def _local_profile(cores: int):
    """A measured-machine profile with flat rates (1 TFLOP/s per thread, 20 GB/s, 1 GB/s gloo)."""
    from shardwise.plan.hardware import Hardware

    rates = {f"{d}@{t}:{w}x{w}": 1.0 * t for d in ("fp32", "bf16") for t in range(1, cores + 1)
             for w in (128, 2048)}
    rates |= {f"attention_{d}@{t}:{h}": 0.5 * t for d in ("fp32", "bf16") for t in range(1, cores + 1)
              for h in (16, 128)}
    return Hardware(name="local", description="test", memory_gib=64, memory_bw_gbs=20, gpus_per_node=cores,
                    intra_node_bw_gbs=1, intra_node_latency_us=50, inter_node_bw_gbs=1,
                    inter_node_latency_us=50, comm_overlap=False, cores=cores, thread_tflops=rates,
                    memory_bw_per_thread_gbs={str(t): 20.0 * t for t in range(1, cores + 1)},
                    overhead_ms={"per_block": 1.0, "per_step": 1.0}, collective_bw_gbs={"2": 1.0, "4": 1.0})


def test_local_profile_lookups():
    """Pairs inside a bigger job use the bandwidth measured with every pair busy; whole groups the
    one measured for the collective and buffer size; attention is interpolated over the measured
    sequence lengths; sharing and per-call waits by process count."""
    import dataclasses

    base = _local_profile(2)
    rates = {**base.thread_tflops, "attention_bf16@1:16:256": 0.02, "attention_bf16@1:16:1024": 0.08}
    hw = dataclasses.replace(base, collective_bw_gbs={"2": 1.0, "4": 0.5, "2@4": 0.25}, thread_tflops=rates,
                             shared_compute={"2": 1.0, "4": 0.8}, collective_sync_us={"2": 500, "4": 2000})
    assert hw.link(2, 2, 2)[0] == 1e9 and hw.link(2, 2, 4)[0] == 0.25e9 and hw.link(4, 4, 4)[0] == 0.5e9
    # per collective kind and buffer size where measured: log-linear between sizes, clamped at the
    # ends, the nearest process count; other kinds (and pairs) as before
    mib = 2**20
    kinds = {"reduce_scatter@4:1048576": 0.1, "reduce_scatter@4:16777216": 0.5, "all_gather@4:16777216": 1.0,
             "reduce_scatter@8:16777216": 0.05}
    hw = dataclasses.replace(hw, collective_kind_bw_gbs=kinds)
    assert hw.link(4, 4, 4, "reduce_scatter", 4 * mib)[0] == pytest.approx(0.3e9)  # log-halfway
    assert hw.link(4, 4, 4, "reduce_scatter", mib // 2)[0] == pytest.approx(0.1e9)
    assert hw.link(4, 4, 4, "all_gather", mib)[0] == pytest.approx(1e9)
    assert hw.link(5, 5, 5, "reduce_scatter", 64 * mib)[0] == pytest.approx(0.5e9)  # 4 is nearest
    assert hw.link(4, 4, 4, "all_to_all", mib)[0] == 0.5e9
    assert hw.link(2, 2, 4, "all_gather", mib)[0] == 0.25e9
    # 512 positions: halfway (in log) between the rates at 256 and 1024, times the core share and sharing
    assert hw.attention_tflops("bf16", 16, ranks=4, seq=512) == pytest.approx(0.05 * 0.5 * 0.8)
    assert hw.sharing(4) == 0.8 and hw.sharing(1) == 1.0 and hw.sync_seconds(4) == pytest.approx(2e-3)
    assert load_hardware("h100").sync_seconds(8) == 0 and load_hardware("h100").sharing(8) == 1


def test_a_context_parallel_ring_costs_its_unmasked_steps_at_their_own_rate():
    """A load-balanced ring over cp ranks makes cp attention calls of equal pairs per block, the
    diagonal one causal and the others unmasked. Measured unmasked at twice the causal rate, cp=2's
    attention costs 3/4 of what the causal rate alone gives; cp=4's 5/8. Profiles without the
    unmasked rates (and GPUs) cost every call at the causal rate."""
    from shardwise.plan.cost import rank_time

    base = _local_profile(2)
    causal = {f"attention_{d}@{t}:16:{s}": 0.02 * t for d in ("fp32", "bf16") for t in (1, 2)
              for s in (128, 1024)}
    ring = {"ring_" + k: 2 * v for k, v in causal.items()}
    old = dataclasses.replace(base, thread_tflops={**base.thread_tflops, **causal})
    new = dataclasses.replace(base, thread_tflops={**base.thread_tflops, **causal, **ring})
    assert new.attention_tflops("bf16", 16, 2, 256, False) == 2 * new.attention_tflops("bf16", 16, 2, 256)
    assert old.attention_tflops("bf16", 16, 2, 256, False) == old.attention_tflops("bf16", 16, 2, 256)
    h100 = load_hardware("h100")
    assert h100.attention_tflops("bf16", 128, 8, 4096, False) == h100.attention_tflops("bf16", 128, 8, 4096)
    for cp, share in ((1, 1.0), (2, 3 / 4), (4, 5 / 8)):
        run = planned(load_config(DEBUG, [f"--parallel.cp={cp}"]), cp)
        st = shape_states(run)[0]
        with_ring, causal_only = (rank_time(run, st, hw).compute["attention"] for hw in (new, old))
        assert with_ring == pytest.approx(share * causal_only), cp


def test_pipeline_ranks_in_the_bubble_lend_their_cores():
    """4 local pipeline ranks on 2 cores: a rank waiting in the bubble gives its core to the others
    (measured: pp4 and pp2 x FSDP2 were the fastest debug layouts on 4 ranks, BENCHMARKS.md), so the
    step is the cores' packed work or the critical path, not the busy time plus the textbook bubble.
    With a core per rank nothing changes; data-parallel layouts are the same either way."""
    from shardwise.plan.cost import pipeline_bubble, pipeline_hop_seconds, step_time

    cfg = load_config(DEBUG, ["--parallel.pp=4", "--training.micro_batch=1"])
    run = planned(cfg, 4)
    states = shape_states(run)
    shared, own = step_time(run, states, _local_profile(2)), step_time(run, states, _local_profile(4))
    busy = max(r.busy for r in shared.ranks)
    assert shared.step < busy + pipeline_bubble(run, busy)
    work = sum(sum(r.compute.values()) for r in shared.ranks) * 2 / 4  # (each costed at half a core)
    assert shared.step >= work / 2
    busy, p2p = max(r.busy for r in own.ranks), pipeline_hop_seconds(run, _local_profile(4))
    assert p2p > 0 and own.step == pytest.approx(busy + pipeline_bubble(run, busy, p2p))
    dp = planned(load_config(DEBUG, ["--parallel.dp_shard=4"]), 4)
    t = step_time(dp, shape_states(dp), _local_profile(2))
    assert t.step == pytest.approx(max(r.busy for r in t.ranks)) and t.bubble == 0


def test_the_fill_and_drain_cross_the_other_stages():
    """The bubble is the other stages' time for one micro-batch beside the slowest's: equal stages
    give the textbook (pp - 1) * t, and a last stage three times as busy (the output head of a small
    model) leaves the fill and the drain only the three short stages to wait for. Local ranks sharing
    cores cost the critical path so; a measured pp4 step on the 125m set was 5.4-5.8 s against 6.4
    predicted with every stage at the slowest's time (docs/planning.md)."""
    from shardwise.plan.cost import RankTime, pipeline_bubble, shared_cores_pipeline

    run = planned(load_config(DEBUG, ["--parallel.pp=4", "--training.micro_batch=1"]), 4)
    m = run.micro_batches
    assert pipeline_bubble(run, 1.0) == pytest.approx(3 / m)
    assert pipeline_bubble(run, [1.0, 1.0, 1.0, 1.0]) == pytest.approx(3 / m)
    assert pipeline_bubble(run, [1.0, 1.0, 1.0, 3.0]) == pytest.approx(3 / m)  # not 3 * 3 / m
    assert pipeline_bubble(run, [1.0, 2.0, 1.0, 3.0]) == pytest.approx(4 / m)
    # a core per rank (8 cores, 4 ranks): the step is the critical path, the slowest stage's work
    # at a full core and the three others' for one micro-batch
    ranks = tuple(RankTime(i, {"matmul": t}, {}, 0.0, 0.0) for i, t in enumerate([1.0, 1.0, 1.0, 3.0]))
    compute, bubble = shared_cores_pipeline(run, ranks, dataclasses.replace(_local_profile(2), cores=8))
    assert compute + bubble == pytest.approx(3.0 + 3 / m)


def test_gemm_rate_on_few_rows():
    """On a measured machine a GEMM on few rows runs at the rate measured on that many rows of the
    nearest widths (by sqrt(k n)), relative to the grid's rate and capped at it; the routed
    experts' GEMMs are costed on their share of the slots. GPU profiles and profiles measured
    before rows were are unchanged."""
    from shardwise.plan.activations import expert_rows, shape_of
    from shardwise.plan.cost import block_gemms

    base = _local_profile(2)  # grid: 1 TFLOP/s per thread at every width
    hw = dataclasses.replace(base, thread_tflops={**base.thread_tflops, "rows_bf16@1:256:64": 0.25,
                                                  "rows_bf16@1:256:256": 0.5, "rows_bf16@1:256:1024": 1.2})
    rate = lambda k, n, rows: hw.matmul_tflops("bf16", k, n, ranks=2, rows=rows)  # noqa: E731
    assert rate(256, 256, 256) == pytest.approx(0.5) and rate(256, 256, 64) == pytest.approx(0.25)
    assert rate(256, 256, 128) == pytest.approx(0.375)  # log-halfway between 64 and 256 rows
    assert rate(128, 512, 256) == pytest.approx(0.5)  # the same work per row as 256 x 256
    assert rate(256, 256, 1024) == rate(256, 256, 4096) == rate(256, 256, 0) == pytest.approx(1.0)
    assert base.matmul_tflops("bf16", 256, 256, 2, rows=64) == pytest.approx(1.0)
    assert hw.matmul_tflops("bf16", 256, 256, ranks=1, rows=64) == pytest.approx(2.0)  # 2 threads: unmeasured
    h100 = load_hardware("h100")
    # (GPUs cost rows by tiles and waves instead: tests/unit/test_plan_gpu.py)
    flat = dataclasses.replace(h100, sms=0)
    assert flat.matmul_tflops("bf16", 4096, rows=64) == flat.matmul_tflops("bf16", 4096)

    cfg = load_config(MOE, [])
    args = model_args(cfg.model)
    for ep in (1, 2):
        s = shape_of(Layout(dp_shard=2, ep=ep, micro_batch=2).resolve(cfg))
        rows = [g.rows for g in block_gemms(s, cfg, layer=1)]
        slots = expert_rows(s)  # (with the CPU's padding: test_cpu_expert_groups_cost_their_padding)
        assert rows[-2:] == [round(slots * ep / args.n_experts)] * 2 and set(rows[:-2]) == {s.tokens}


def test_large_outputs_cost_what_the_allocator_makes_them():
    """Outputs over 16 MiB are fresh pages with glibc's default malloc (the ``large`` rate: 6.7
    against 53 GB/s on one thread here) but the heap's resident pages when the run keeps freed
    memory, as training does by default (``cached``: 30 GB/s); profiles from before the cached rate
    was measured use the small-tensor rate. A step's memory-bound time follows run.cpu_memory_cache.
    """
    from shardwise.plan.cost import rank_time

    base = _local_profile(2)
    hw = dataclasses.replace(base, memory_bw_per_thread_gbs={"1": 50.0, "large@1": 5.0, "cached@1": 30.0})
    big, small = 32 * 2**20, 2**20
    assert hw.memory_bw(2, big) == pytest.approx(30e9)  # 1 thread each, a full core
    assert hw.memory_bw(4, big, cached=False) == pytest.approx(5e9 / 2)  # half a core each
    assert hw.memory_bw(4, small, cached=False) == hw.memory_bw(4, small) == pytest.approx(50e9 / 2)
    old = dataclasses.replace(hw, memory_bw_per_thread_gbs={"1": 50.0, "large@1": 5.0})
    assert old.memory_bw(4, big) == pytest.approx(50e9 / 2)

    times = {}
    for cache in (True, False):  # the 125m head: 32000-wide logits, over 16 MiB in fp32
        cfg = load_config(DEBUG, ["--parallel.dp_shard=4", "--model.name=125m", "--training.seq_len=256",
                                  "--training.loss=plain", f"--run.cpu_memory_cache={str(cache).lower()}"])
        run = planned(cfg, 4)
        times[cache] = rank_time(run, shape_states(run)[0], hw).compute["memory-bound"]
    assert times[False] > 2 * times[True]


def test_memory_efficiency_makes_the_probe_step_its_own_measurement():
    """``calibrate`` times one real step of its probe model against its own GEMMs and attention;
    the fraction of the elementwise bandwidth it derives from the remainder scales every
    memory-bound term on ``local``, and with it the probe's predicted step beyond its GEMMs and
    attention is the measured remainder. FSDP's copies (large copies, not a step's small eager ops)
    stay at the microbenchmark's rate, on both sides."""
    from shardwise.plan.activations import shape_of
    from shardwise.plan.cost import ComputeTally, fsdp_copy_traffic
    from shardwise.plan.estimate import estimate
    from shardwise.plan.probes import PROBE, memory_efficiency

    hw = _local_profile(2)
    cfg = resolved_config(None, list(PROBE), device="cpu")
    est = estimate(cfg, 1, hw)
    parts = est.time.ranks[0].compute
    copies = ComputeTally(hw, 1)
    fsdp_copy_traffic(copies, est.run, est.states[0], shape_of(est.run))
    elementwise = parts["memory-bound"] + parts["optimizer"] - copies.memory
    assert 0 < copies.memory < elementwise
    # the step less its GEMMs and attention, measured: the elementwise work at half the rate
    rest = parts["host"] + copies.memory + 2 * elementwise
    eff = memory_efficiency(hw, rest)
    assert eff == pytest.approx(0.5)
    slow = dataclasses.replace(hw, efficiency={"memory": eff})
    assert slow.memory_bw(4, 2**20) == pytest.approx(hw.memory_bw(4, 2**20) / 2)
    assert slow.memory_bw(4, 2**20, elementwise=False) == hw.memory_bw(4, 2**20)
    assert estimate(cfg, 1, slow).time.step == pytest.approx(parts["matmul"] + parts["attention"] + rest)
    # clamped: a remainder within the host time leaves the bandwidth as measured
    assert memory_efficiency(hw, parts["host"]) == 1.0


def test_the_probes_kernels_are_the_cost_models_gemms_and_attention(monkeypatch: pytest.MonkeyPatch):
    """What the probe step is timed against: every GEMM the cost model counts for it (each block's,
    and the output head's over the fused loss's chunks) and each block's attention, once each."""
    from shardwise.plan import probes

    made = []  # (each call of a kernel: the fakes record when run)
    monkeypatch.setattr(probes, "linear_step",
                        lambda dtype, k, n, rows: lambda: made.append(("mm", k, n, rows)))
    monkeypatch.setattr(probes, "attention_step", lambda *a: lambda: made.append(("sdpa", *a[1:])))
    probes.probe_kernels(list(probes.PROBE))()
    tokens, mm = 4 * 256, [m for m in made if m[0] == "mm"]
    assert sorted(mm[:7]) == sorted([("mm", 192, 192, tokens)] * 4 + [("mm", 192, 512, tokens)] * 2
                                    + [("mm", 512, 192, tokens)])
    assert len(mm) == 3 * 7 + 1 and mm[-1] == ("mm", 192, 1024, tokens)
    assert [m for m in made if m[0] == "sdpa"] == [("sdpa", 4, 6, 256, 32)] * 3


def test_cpu_expert_groups_cost_their_padding():
    """On CPU each expert's rows are padded to a multiple of 64 (moe.group_alignment): on moe-debug
    with 2 sequences a rank routes 2048 slots to 8 experts, 256 rows each plus 31.5 of padding on
    average; GPUs run the groups unpadded. The grouped GEMMs cost the padded rows."""
    from shardwise.plan.activations import expert_rows, shape_of
    from shardwise.plan.cost import block_gemms

    shapes = {}
    for device in ("cpu", "cuda"):
        cfg = resolved_config(MOE, ["--parallel.dp_shard=4"], device=device)
        shapes[device] = (cfg, shape_of(planned(cfg, 4)))
    assert expert_rows(shapes["cpu"][1]) == 2048 + 8 * 31.5 and expert_rows(shapes["cuda"][1]) == 2048
    cpu, gpu = (block_gemms(shape, cfg, 2) for cfg, shape in shapes.values())
    grouped = slice(-2, None)  # the linear layers first, then the grouped experts' two GEMMs
    assert [g[0] for g in cpu[grouped]] == pytest.approx([g[0] * 2300 / 2048 for g in gpu[grouped]])
    assert [g[5] for g in cpu[grouped]] == [288, 288] and [g[5] for g in gpu[grouped]] == [256, 256]
    assert cpu[:-2] == gpu[:-2]


def test_ranking_report_counts_the_orders_any_prediction_could_reach(tmp_path):
    """bench/plan_ranking.py's reachability line: three layouts that swap between two repeats leave
    few orders meeting Spearman >= 0.8 in both; layouts in one order in every repeat leave exactly
    the orders near it. And a stored round is rescored on its own calibration: the profile stored
    in its file predicts what the same profile does loaded as a TOML file."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import plan_ranking

    steady = [[1.0, 2.0, 3.0, 4.0, 5.0]] * 3
    met, best = plan_ranking.reachable(steady)
    assert best == pytest.approx(1.0) and 1 < met < 120
    swapped = [[1.0, 1.01, 1.02, 4.0, 5.0], [1.02, 1.01, 1.0, 4.0, 5.0]]
    met2, best2 = plan_ranking.reachable(swapped)
    assert met2 < met and best2 < 1.0
    # the orders counted are exactly those whose worst repeat is >= 0.8
    import itertools
    assert met2 == sum(min(plan_ranking.spearman([float(i) for i in o], m) for m in swapped) >= 0.8
                       for o in itertools.permutations(range(5)))

    import tomli_w

    r = json.loads((ROOT / "tests" / "fixtures" / "planner" / "ranking_avx512_debug.json").read_text())
    base, layouts = plan_ranking.SETS["debug"]
    toml = tmp_path / "hw.toml"
    toml.write_text(tomli_w.dumps(r["profile"]))
    for layout in (layouts[0], layouts[-1]):
        name, step = plan_ranking.predict(base, layout, r["hardware"], r["profile"])
        assert (name, step) == plan_ranking.predict(base, layout, str(toml))
    assert name == r["layouts"][-1]


def test_expert_parallel_is_costed_at_its_busiest_rank():
    """parallel.expert_load (the busiest expert's tokens over the mean, as training logs it): an
    expert-parallel rank holding that expert computes and receives its share -- the expert's load and
    the average of the others (moe-debug, 8 experts: 2 per rank at ep=4) -- while without expert
    parallel every rank still routes its own tokens, whatever the imbalance."""
    from shardwise.plan.activations import ep_rank_load, expert_rows, shape_of
    from shardwise.plan.estimate import estimate

    assert ep_rank_load(2.0, 8, 4) == pytest.approx((2 + 6 / 7) / 2)  # the others share 6 of 8
    assert ep_rank_load(2.0, 8, 8) == 2.0 and ep_rank_load(3.0, 8, 1) == ep_rank_load(1.0, 8, 4) == 1.0
    h100 = load_hardware("h100")
    est, rows = {}, {}
    for ep in (1, 4):
        for load in (1.0, 2.0):
            cfg = resolved_config(MOE, ["--parallel.dp_shard=4", f"--parallel.ep={ep}",
                                        f"--parallel.expert_load={load}"], device="cuda")
            rows[ep, load] = expert_rows(shape_of(planned(cfg, 4)))
            est[ep, load] = estimate(cfg, 4, h100)
    factor = ep_rank_load(2.0, 8, 4)
    assert rows[1, 2.0] == rows[1, 1.0] and rows[4, 2.0] == round(rows[4, 1.0] * factor)
    assert est[1, 2.0].time == est[1, 1.0].time
    tokens = {load: [c.nbytes for c in est[4, load].collectives[0] if c.what == "expert-parallel tokens"]
              for load in (1.0, 2.0)}
    assert tokens[1.0] and tokens[2.0] == [round(b * factor) for b in tokens[1.0]]
    assert est[4, 2.0].time.step > est[4, 1.0].time.step and est[4, 2.0].peak > est[4, 1.0].peak
    with pytest.raises(ConfigError, match="parallel.expert_load must be >= 1"):
        planned(resolved_config(MOE, ["--parallel.expert_load=0.5"]), 1)
    with pytest.raises(ConfigError, match="exceeds n_experts/top_k=4"):
        planned(resolved_config(MOE, ["--parallel.expert_load=5"]), 1)
