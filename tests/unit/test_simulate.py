"""Many ranks simulated in one process (torch's ``torch.distributed._local_tensor``, a private module:
its behaviour is pinned here) and shardwise/trainer/simulate.py's adapters: shardwise's own init,
tensor-parallel plan and FSDP2 (each rank its own, uneven or empty, shard) run on simulated ranks and
compute what one rank does; document-masked attention runs each rank's own documents; what the
simulation does not carry yet is refused in one line."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._local_tensor as lt
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh

from shardwise.config.schema import ConfigError
from shardwise.models.layers import DocumentSpans, attention_by_document
from shardwise.models.transformer import build_model, init_weights
from shardwise.parallel.dims import Mesh
from shardwise.parallel.fsdp import apply_fsdp, mixed_precision_policy
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.tensor import apply_tp
from shardwise.resolve.run import resolve_run
from shardwise.trainer import simulate, simulate_stages
from shardwise.trainer.simulate_dispatch import _run_each
from shardwise.verify.simulated import check_simulated
from tests.helpers import TINY_ARGS, TINY_MODEL, resolved_config, run_cli


def test_tensor_parallel_on_simulated_ranks_computes_what_one_rank_does():
    """The tiny model under TP over 2 simulated ranks (meta -> apply_tp -> materialize -> init, as the
    trainer builds it): logits and every parameter's gradient equal the one-rank model's (fp32) on
    every rank, and the weights really are sharded (each rank holds half of a column-parallel weight)."""
    ranks = 2
    ref = build_model(TINY_MODEL, device="cpu")
    init_weights(ref, 0)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref_out = ref(tokens)
    grads = torch.autograd.grad(ref_out.square().mean(), list(ref.parameters()))
    ref_grads = dict(zip([n for n, _ in ref.named_parameters()], grads, strict=True))
    cfg = resolved_config(None, [f"--parallel.tp={ranks}", "--parallel.loss_parallel=false"])
    with simulate.simulated_world(ranks):
        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
        model = build_model(TINY_MODEL, device="meta")
        apply_tp(model, mesh, cfg.parallel)
        model.to_empty(device="cpu")
        simulate.adapt(model)
        init_weights(model, 0)
        wq = model.layers["0"].attention.wq.weight
        assert [t.shape[0] for t in simulate.every_rank_tensor(wq).values()] == [wq.shape[0] // ranks] * ranks
        out = model(tokens)
        names = [n for n, _ in model.named_parameters()]
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
        got = {n: simulate.every_rank_tensor(g.full_tensor() if hasattr(g, "full_tensor") else g)
               for n, g in zip(names, grads, strict=True)}
        logits = simulate.every_rank_tensor(out)
    assert not dist.is_initialized()  # the simulated world is gone
    for r in range(ranks):
        torch.testing.assert_close(logits[r], ref_out, atol=1e-5, rtol=1e-5)
    assert got.keys() == ref_grads.keys()
    for name, by_rank in got.items():
        for r, g in by_rank.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=f"{name} rank {r}")


@pytest.mark.parametrize("ranks", [8, 32])
def test_fsdp_on_simulated_ranks_gives_each_rank_its_own_chunk_and_one_ranks_gradients(ranks: int):
    """FSDP2 over 8 and 32 simulated ranks of the tiny model (vocabulary 97: uneven chunks; at 32,
    the 64-entry norms leave ranks 16.. empty and the embedding's last ranks short or empty): each
    rank holds exactly torch.chunk's piece of every parameter (refill_shards), and one forward and
    backward, each rank on its own sequences, gives every parameter the one-rank gradient (fp32).
    Without the refill, every rank would hold rank 0's chunk shape and the init fails."""
    ref = build_model(TINY_MODEL, device="cpu")
    init_weights(ref, 0)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (ranks, 16), generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(ref(tokens).square().mean(), list(ref.parameters()))
    ref_grads = dict(zip([n for n, _ in ref.named_parameters()], grads, strict=True))
    cfg = resolved_config(None, [f"--parallel.dp_shard={ranks}"])

    with simulate.simulated_world(ranks):
        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp_shard",))
        model = build_model(TINY_MODEL, device="meta")
        apply_fsdp(model, mesh, cfg.parallel, mixed_precision_policy("fp32", "fp32"))
        model.to_empty(device="cpu")
        simulate.adapt(model)
        init_weights(model, 0)
        empty = 0
        for name, p in model.named_parameters():
            want = torch.chunk(ref.get_parameter(name).detach(), ranks)
            for r, local in simulate.every_rank_tensor(p).items():
                expect = want[r] if r < len(want) else want[0][:0]
                assert local.shape == expect.shape and torch.equal(local, expect), (name, r)
                empty += local.numel() == 0
        out = model(simulate.from_ranks({r: tokens[r:r + 1] for r in range(ranks)}))
        (out.square().mean() / ranks).backward()  # FSDP sums over ranks: the whole batch's mean
        grads = {n: simulate.every_rank_tensor(p.grad.full_tensor()) for n, p in model.named_parameters()}
    assert (empty > 0) == (ranks == 32)
    for name, by_rank in grads.items():
        for r, g in by_rank.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=f"{name} rank {r}")


def test_document_masked_attention_runs_each_ranks_own_documents():
    """RankDocuments: each simulated rank's document ids give its own spans, and the attention of each
    rank (forward and every input's gradient) equals attention_by_document on that rank's tensors
    alone; ranks with different documents get different outputs."""
    ranks, b, h, s, d = 3, 2, 4, 16, 8
    g = torch.Generator().manual_seed(0)
    qkv = {r: [torch.randn(b, h, s, d, generator=g) for _ in range(3)] for r in range(ranks)}
    docs = {r: torch.cumsum(torch.rand(b, s, generator=g) < 0.1 * (r + 1), dim=1) for r in range(ranks)}
    upstream = {r: torch.randn(b, h, s, d, generator=g) for r in range(ranks)}
    want = {}
    for r in range(ranks):
        ins = [t.clone().requires_grad_() for t in qkv[r]]
        out = attention_by_document(*ins, DocumentSpans.of(docs[r]))
        want[r] = (out.detach(), torch.autograd.grad(out, ins, upstream[r]))
    with simulate.simulated_world(ranks):
        ins = [simulate.from_ranks({r: qkv[r][i] for r in range(ranks)}).requires_grad_() for i in range(3)]
        spans = simulate.RankDocuments.of(simulate.from_ranks(docs))
        assert [spans.spans[r] for r in range(ranks)] == [DocumentSpans.of(docs[r]) for r in range(ranks)]
        out = spans.attention(*ins, None)
        grads = torch.autograd.grad(out, ins, simulate.from_ranks(upstream))
        got = {r: (simulate.every_rank_tensor(out)[r], [simulate.every_rank_tensor(t)[r] for t in grads])
               for r in range(ranks)}
    for r in range(ranks):
        torch.testing.assert_close(got[r][0], want[r][0], atol=0, rtol=0)
        for a, e in zip(got[r][1], want[r][1], strict=True):
            torch.testing.assert_close(a, e, atol=0, rtol=0)
    assert not torch.equal(got[0][0], got[2][0])


@pytest.mark.parametrize(("extra", "world", "what"), [
    (["--parallel.cp=2"], 2, "context parallel"),
    (["--float8.enabled=true"], 2, "float8"),
    (["--compile.enabled=true"], 2, "compile"),
])
def test_what_the_simulation_does_not_carry_yet_is_refused_in_one_line(extra: list[str], world: int,
                                                                       what: str):
    cfg = resolved_config(None, [*TINY_ARGS[2:], *extra], device="cpu")
    with pytest.raises(ConfigError) as e:
        check_simulated(resolve_run(cfg, world, detect_device=False))
    assert what in str(e.value) and "\n" not in str(e.value) and "--nproc" in str(e.value)


@pytest.mark.parametrize(("args", "says"), [
    (["--ranks", "4", "--nproc", "4"], "give one"),
    (["--ranks", "2000"], "2..1024"),
    (["--ranks", "4", "--layouts", "cp=2,dp_shard=2"], "context parallel"),
    (["--ranks", "4", "--shrink", "3"], "--shrink 3 does not divide model.dim=256"),
    (["--ranks", "4", "--shrink-experts", "2"], "give --shrink too"),
    (["--ranks", "4", "--shrink", "16"], "--shrink 16 does not divide model.head_size=16 into an even width"),
])
def test_verify_ranks_refuses_bad_input_in_one_line_before_any_run(args: list[str], says: str, tmp_path):
    proc = run_cli(["verify", "--config", "configs/debug.toml", *args, "--out", str(tmp_path / "v")],
                   check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "v").exists()


def test_compile_left_to_auto_is_not_refused():
    """A run long enough for compile.enabled=auto to compile (training.steps >= 300) is simulated eager,
    not refused: only compile asked for by name is."""
    cfg = resolved_config(None, [*TINY_ARGS[2:], "--compile.enabled=auto", "--training.steps=1000"],
                          device="cpu")
    check_simulated(resolve_run(cfg, 2, detect_device=False))


def _on_each(ranks: list[int], value) -> torch.Tensor:  # noqa: ANN001 - (rank) -> plain tensor
    """A simulated tensor of plain per-rank values, made with the calling thread's mode off (a
    factory call under the mode would itself make a simulated tensor)."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        values = {r: value(r) for r in ranks}
    return simulate.from_ranks(values)


def _pipeline_world(fn):  # noqa: ANN001, ANN202 - a test helper
    """``fn(pp_index, pp_group)`` on 8 simulated ranks, pp=2 x dp=4, each pipeline rank a thread."""
    with simulate.simulated_ranks(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        slices = simulate.stage_slices(mesh["pp"])
        assert slices == [frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})]
        group = mesh["pp"].get_group()
        return simulate.on_ranks(slices, lambda: fn(dist.get_rank(group), group))


def test_pipeline_ranks_exchange_each_ranks_own_tensors_matched_in_the_order_posted():
    """Each pipeline rank's slice runs in a thread: its index in the pp group is its own, each
    simulated rank sends to its own peer, and receives match sends in the order they were posted,
    whatever order they are waited on (zero-bubble V posts early and waits late: waiting in posting
    order gave its stages each other's activations)."""
    def stage(pp: int, group: dist.ProcessGroup) -> dict[int, list[float]]:
        ranks = sorted(simulate.every_rank_tensor(torch.zeros(())))
        if pp == 0:  # (rank 1 has started before rank 0 sends: rank 0 leaves first)
            dist.recv_object_list([None], group_src=1, group=group)
            for k in (1.0, 2.0):  # two messages from each rank r to rank r + 4: r + k
                dist.isend(_on_each(ranks, lambda r, k=k: torch.tensor([r + k])), group_dst=1, group=group)
            return {}
        dist.send_object_list(["started"], group_dst=0, group=group)
        first, second = (_on_each(ranks, lambda r: torch.zeros(1)) for _ in range(2))
        works = [dist.irecv(first, group_src=0, group=group), dist.irecv(second, group_src=0, group=group)]
        works[1].wait()  # the later posted, waited on first
        works[0].wait()
        return {r: [float(first._local_tensors[r]), float(second._local_tensors[r])] for r in ranks}

    before = dist.DeviceMesh.get_coordinate, torch.manual_seed
    got = _pipeline_world(stage)
    assert got[1] == {r: [r - 4 + 1.0, r - 4 + 2.0] for r in range(4, 8)}
    # each thread's mode patched DeviceMesh and torch's seeding on entry: all put back after
    assert (dist.DeviceMesh.get_coordinate, torch.manual_seed) == before


def test_a_pipeline_rank_computes_its_own_coordinates_while_another_waits():
    """While one pipeline rank waits for a message, the one that runs computes each of its ranks' own
    mesh coordinates (a wait with the waiting thread's mode disabled took torch's DeviceMesh patches
    away from every thread: the running one computed rank 0's coordinates for all its ranks, and
    the first micro-batch of PP x TP embedded with rank 0's vocabulary range)."""
    def stage(pp: int, group: dist.ProcessGroup) -> dict[int, int]:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        ranks = sorted(simulate.every_rank_tensor(torch.zeros(())))
        data = _on_each(ranks, lambda r: torch.zeros(1))
        if pp == 0:  # (both threads have entered their modes when rank 0 waits on a tensor)
            dist.recv_object_list([None], group_src=1, group=group)
            dist.send_object_list(["waiting"], group_dst=1, group=group)
            dist.irecv(data, group_src=1, group=group).wait()
            return simulate.coordinates(mesh["dp"])
        dist.send_object_list(["started"], group_dst=0, group=group)
        dist.recv_object_list([None], group_src=0, group=group)
        where = simulate.coordinates(mesh["dp"])  # (while rank 0 waits)
        dist.isend(data, group_dst=0, group=group)
        return where

    got = _pipeline_world(stage)
    assert got == [{0: 0, 1: 1, 2: 2, 3: 3}, {4: 0, 5: 1, 6: 2, 7: 3}]


def test_a_pipeline_rank_computes_its_own_coordinates_after_another_has_finished():
    """A pipeline rank still running when another has returned computes each of its ranks' own mesh
    coordinates, and torch's DeviceMesh is its own again after: each thread's mode patches it
    process-wide and puts back what it found, so a thread leaving first unpatched it under the
    other (which then cut the first reference tensor it compared by rank 0's coordinates: an MoE
    model's pipeline failed verify with correct weights), and the last left it patched."""
    def stage(pp: int, group: dist.ProcessGroup) -> dict[int, int]:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        if pp == 0:
            dist.recv_object_list([None], group_src=1, group=group)  # (both threads in their modes)
            return simulate.coordinates(mesh["dp"])
        dist.send_object_list(["started"], group_dst=0, group=group)
        stages = lt._LOCAL_RUNNER_MODE
        stages.wait_until(lambda: stages.alive == 1, "pipeline rank 0 to return")
        return simulate.coordinates(mesh["dp"])

    before = dist.DeviceMesh.get_coordinate, dist.DeviceMesh.get_local_rank
    got = _pipeline_world(stage)
    assert got == [{0: 0, 1: 1, 2: 2, 3: 3}, {4: 0, 5: 1, 6: 2, 7: 3}]
    assert (dist.DeviceMesh.get_coordinate, dist.DeviceMesh.get_local_rank) == before


def test_an_all_reduce_over_pipeline_ranks_sums_across_their_threads_and_other_collectives_are_refused():
    def stage(pp: int, group: dist.ProcessGroup) -> tuple[dict[int, float], str]:
        ranks = sorted(simulate.every_rank_tensor(torch.zeros(())))
        t = _on_each(ranks, lambda r: torch.tensor(float(r)))
        dist.all_reduce(t, group=group)  # rank r and r + 4 (or r - 4)
        try:
            dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1), group=group)
            refused = ""
        except NotImplementedError as e:
            refused = str(e)
        return simulate.every_rank(t), refused

    got = _pipeline_world(stage)
    sums = {**got[0][0], **got[1][0]}
    assert sums == {r: float(r % 4 + r % 4 + 4) for r in range(8)}
    assert all("several pipeline stages is not simulated" in refused for _, refused in got)


@pytest.mark.parametrize("fault", ["raises", "deadlock"])
def test_a_failing_or_deadlocked_pipeline_rank_stops_the_simulation_with_its_error(fault: str, monkeypatch):
    """One pipeline rank raising (while the other waits for it), or both waiting on each other, ends
    the run with that error: the simulation never hangs."""
    monkeypatch.setattr(simulate_stages, "STALL_SECONDS", 0.2)

    def stage(pp: int, group: dist.ProcessGroup) -> None:
        buffer = _on_each(sorted(simulate.every_rank_tensor(torch.zeros(()))), lambda r: torch.zeros(1))
        if fault == "raises" and pp == 0:
            raise ValueError("stage 0 broke")
        dist.irecv(buffer, group_src=1 - pp, group=group).wait()

    with pytest.raises(ValueError if fault == "raises" else RuntimeError,
                       match="stage 0 broke" if fault == "raises" else "deadlock"):
        _pipeline_world(stage)


@pytest.mark.parametrize(("preset", "factor"), [("405b", 64), ("deepseek-v3-671b", 32), ("debug", 8)])
def test_shrink_keeps_what_decides_the_layout_and_divides_the_widths(preset: str, factor: int):
    """``--shrink`` (alone: the largest power of two that keeps RoPE's rotated width even) keeps the
    blocks, heads, vocabulary and every expert and routing count, and divides each hidden width: the
    narrowed model, resolved from its overrides as a run resolves it, is the preset with only those
    widths changed."""
    from shardwise.models.presets import PRESETS
    from shardwise.resolve.checks import load_config
    from shardwise.resolve.run import resolve_model
    from shardwise.verify.shrink import KEPT, KEPT_MOE, largest_factor, shrink, widths

    full = PRESETS[preset]
    assert largest_factor(full) == factor
    overrides, said = shrink(full, factor)
    narrow = resolve_model(load_config(None, [f"--model.name={preset}", *overrides]))
    for name in (*KEPT, *KEPT_MOE):
        assert getattr(narrow, name) == getattr(full, name), name
        assert full.n_experts == 0 and name in KEPT_MOE or f"{name}={getattr(full, name)}" in said
    assert widths(narrow) == {n: v // factor for n, v in widths(full).items()}
    rotated = narrow.qk_rope_head_dim or narrow.head_size
    assert rotated % 2 == 0 and narrow.dim * factor == full.dim


def test_shrink_experts_narrows_only_the_routed_experts_further():
    """``--shrink-experts M``: the routed experts' hidden width divided M-fold beyond ``--shrink``'s,
    every other width ``--shrink``'s alone, said in the notice; a factor that does not divide the
    width, or a model without experts, is refused in one line."""
    from shardwise.models.presets import PRESETS
    from shardwise.verify.shrink import shrink, widths

    full = PRESETS["deepseek-v3-671b"]
    plain, _ = shrink(full, 32)
    narrow, said = shrink(full, 32, 8)
    assert "moe_hidden_dim 2048 -> 8" in said
    assert [o for o in narrow if "moe_hidden_dim" not in o] == [o for o in plain if "moe_hidden_dim" not in o]
    assert "--model.moe_hidden_dim=8" in narrow and "--model.moe_hidden_dim=64" in plain
    assert widths(full)["moe_hidden_dim"] == 2048
    for args, factor, experts, says in ((full, 32, 3, "does not divide model.moe_hidden_dim=2048"),
                                        (PRESETS["debug"], 8, 2, "this model has none")):
        with pytest.raises(ConfigError) as e:
            shrink(args, factor, experts)
        assert says in str(e.value) and "\n" not in str(e.value)


def _train_fsdp_tp_on_8_ranks() -> tuple[dict[str, dict[int, torch.Tensor]], dict[int, torch.Tensor],
                                         torch.Tensor]:
    """The tiny model (vocabulary 100: uneven FSDP chunks of each 50-row TP shard) under FSDP4 x TP2
    on 8 simulated ranks from one seed: random init, two AdamW steps on each rank's own tokens, then
    a draw from every rank's generator. Every rank's weights and draw, and the process's generator
    after."""
    cfg = resolved_config(None, ["--parallel.dp_shard=4", "--parallel.tp=2", "--parallel.loss_parallel=false",
                                 "--training.mixed_precision=fp32"])
    run = resolve_run(cfg, 8, detect_device=False)
    args = dataclasses.replace(TINY_MODEL, vocab_size=100)
    tokens = torch.randint(0, args.vocab_size, (4, 2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    with simulate.simulated_world(8):
        run.dims.build_mesh("cpu")
        model = build_model(args, device="meta")
        parallelize(model, run.dims, cfg)
        model.to_empty(device="cpu")
        simulate.adapt(model)
        init_weights(model, 0)  # (DTensor's random init: the generator-drawing path)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dp = simulate.coordinates(run.dims.submesh(Mesh.DP))
        for _ in range(2):
            model(simulate.from_ranks({r: tokens[dp[r]] for r in range(8)})).square().mean().backward()
            opt.step()
            opt.zero_grad()
        weights = {n: simulate.every_rank_tensor(p.full_tensor()) for n, p in model.named_parameters()}
        draw = simulate.every_rank_tensor(torch.rand(3))
    return weights, draw, torch.get_rng_state()


def test_the_lean_per_rank_loop_computes_what_torchs_loop_computes_bitwise(monkeypatch):
    """lean_dispatch (operations that draw no random numbers skip torch's per-rank generator copies)
    against torch's own loop: the same init, training and generator draws, bitwise on every rank, and
    the process's generator left where torch's loop leaves it."""
    lean = _train_fsdp_tp_on_8_ranks()
    monkeypatch.setattr(simulate, "lean_dispatch", contextlib.nullcontext)
    torchs = _train_fsdp_tp_on_8_ranks()
    for name, by_rank in torchs[0].items():
        for r, t in by_rank.items():
            assert torch.equal(lean[0][name][r], t), (name, r)
    assert lean[1].keys() == torchs[1].keys()
    assert all(torch.equal(lean[1][r], t) for r, t in torchs[1].items())
    assert torch.equal(lean[2], torchs[2])


def test_the_lean_loop_waits_for_an_argument_still_in_flight_and_gives_each_rank_its_own() -> None:
    """An operation handed a collective's result still in flight (an ``AsyncCollectiveTensor`` around
    a simulated tensor) runs on each rank's own tensor once it is waited for, as torch's loop does."""
    with lt.LocalTensorMode(2):
        pending = AsyncCollectiveTensor(lt.LocalTensor({0: torch.ones(2), 1: 2 * torch.ones(2)}))
        out = _run_each(lt, torch.ops.aten.add.Tensor, frozenset({0, 1}), (pending, 1.0), {}, True)
        got = {r: t.tolist() for r, t in out._local_tensors.items()}
    assert got == {0: [2.0, 2.0], 1: [3.0, 3.0]}
