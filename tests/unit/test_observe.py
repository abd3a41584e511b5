"""FLOPs per token, device peaks (table, override, measured and cached) and MFU arithmetic."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from shardwise.models import PRESETS, ModelArgs
from shardwise.models.transformer import build_model
from shardwise.observe import peak as peak_mod
from shardwise.observe.flops import flops_per_token, num_params
from shardwise.observe.metrics import Throughput


def test_flops_per_token_palm_convention():
    a = PRESETS["debug"]
    n = sum(p.numel() for name, p in build_model(a).named_parameters() if name != "tok_embeddings.weight")
    assert flops_per_token(a, 2048) == 6 * n + 12 * a.n_layers * a.dim * 2048


def test_llama3_8b_worked_example():
    """docs/observability.md's worked example, figure by figure (Llama 3 8B at sequence 8192)."""
    from shardwise.observe.flops import attention_pairs, executed_flops, matmul_params

    a, s = PRESETS["8b"], 8192
    assert num_params(a, include_embedding=False) == 7_504_924_672  # non-embedding N
    assert flops_per_token(a, s) == 57_914_449_920
    assert 12 * a.n_layers * a.n_heads * a.head_dim * s / 1e9 == pytest.approx(12.88, abs=5e-3)
    assert matmul_params(a) == 7_504_658_432
    plain = executed_flops(a, s, attention_pairs(s))
    assert plain.matmul / s / 1e9 == pytest.approx(45.03, abs=5e-3)
    assert plain.attention / s / 1e9 == pytest.approx(7.52, abs=5e-3)
    assert plain.total / s / 1e9 == pytest.approx(52.55, abs=5e-3)
    assert plain.total / s / flops_per_token(a, s) == pytest.approx(0.907, abs=5e-4)
    full = executed_flops(a, s, attention_pairs(s), recompute="full")
    assert (full.matmul - plain.matmul) / s / 1e9 == pytest.approx(10.20, abs=5e-3)
    assert (full.attention - plain.attention) / s / 1e9 == pytest.approx(2.15, abs=5e-3)


def test_tied_embedding_counts_once_as_the_output_matmul():
    a = PRESETS["1b"]
    assert num_params(a) == sum(p.numel() for p in build_model(a).parameters())
    assert flops_per_token(a, 1) == 6 * num_params(a) + 12 * a.n_layers * a.dim


@pytest.mark.parametrize("name,row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA B200", "B200"), ("AMD Instinct MI300X", "MI300X"), ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names_map_to_the_right_peak_row(name: str, row: str | None):
    assert peak_mod.gpu_peak_name(name) == row


def test_override_wins():
    assert peak_mod.peak_tflops(torch.device("cpu"), "bf16", override=123.0) == (123.0, "metrics.peak_tflops")


def test_cpu_peak_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def fake_measure(dtype, device, n=2048, seconds=1.0):
        calls.append((dtype, n))
        return {256: 0.3, 512: 0.6, 1024: 0.5}.get(n, 0.7)

    monkeypatch.setattr(peak_mod, "measure_gemm_tflops", fake_measure)
    value, source = peak_mod.peak_tflops(torch.device("cpu"), "fp32", cache_dir=str(tmp_path))
    assert value == 0.7 and "measured fp32 GEMM" in source
    assert peak_mod.peak_tflops(torch.device("cpu"), "fp32", cache_dir=str(tmp_path))[0] == 0.7
    assert [n for _, n in calls] == [256, 512, 1024, 2048]  # every size, measured once; the
    # second call read the cache
    cache = json.loads((tmp_path / "peak_tflops.json").read_text())
    assert any("threads=" in k and "fp32" in k for k in cache)


def test_cpu_peak_of_emulated_bf16_is_measured_in_a_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A CPU without native bf16 runs it at about 0.002 TFLOP/s: one 2048 product would take 9 s,
    so the sizes stop where one product would pass a second (they held a bf16 run's first step
    for 6 minutes before)."""
    calls = []

    def fake_measure(dtype, device, n=2048, seconds=1.0):
        calls.append(n)
        return 0.002

    monkeypatch.setattr(peak_mod, "measure_gemm_tflops", fake_measure)
    assert peak_mod.peak_tflops(torch.device("cpu"), "bf16", cache_dir=str(tmp_path))[0] == 0.002
    assert calls == [256, 512]  # a 1024 product at 0.002 TFLOP/s would take 1.07 s


def test_cpu_peak_is_not_a_slow_small_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Native bf16 whose small GEMMs run far below its large ones (packing): the slow 256 rate must
    not rule the large sizes out, or MFU is measured against a peak below what the model reaches
    (the likely way a CI run of the 256-probe rule logged MFU over 100%)."""
    rates = {256: 0.004, 512: 0.02, 1024: 0.08, 2048: 0.1}
    monkeypatch.setattr(peak_mod, "measure_gemm_tflops", lambda dtype, device, n, seconds: rates[n])
    assert peak_mod.peak_tflops(torch.device("cpu"), "bf16", cache_dir=str(tmp_path))[0] == 0.1


def test_gemm_peak_covers_the_layouts_a_linear_layer_runs():
    """The measured peak is at least about what ``F.linear`` (``a @ b.T``) alone reaches: on CPUs
    without native bf16, ``a @ b`` alone ran ten times slower, and MFU against it read 240%."""
    import time

    import torch.nn.functional as F

    a, b = torch.randn(256, 256).bfloat16(), torch.randn(256, 256).bfloat16()
    F.linear(a, b)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        F.linear(a, b)
        calls += 1
    linear = calls * 2 * 256**3 / (time.perf_counter() - start) / 1e12
    measured = peak_mod.measure_gemm_tflops(torch.bfloat16, torch.device("cpu"), n=256, seconds=0.4)
    assert measured > 0.5 * linear, (measured, linear)


def test_throughput_mfu_arithmetic(monkeypatch: pytest.MonkeyPatch):
    clock = itertools.chain([0.0], itertools.repeat(2.0))  # start, then 2 s later (and the reset)
    monkeypatch.setattr("shardwise.observe.metrics.time.perf_counter", lambda: next(clock))
    t = Throughput(flops_per_token=1e9, peak_tflops=1.0, world_size=2)
    t.add(1000, 3e11)
    t.add(1000, torch.tensor(1e11, dtype=torch.float64))  # a device count is fine too
    w = t.window()
    assert w["tokens_per_s"] == 1000 and w["tokens_per_s_per_device"] == 500
    assert w["step_time_s"] == 1.0 and w["mfu"] == pytest.approx(500 * 1e9 / 1e12)
    assert w["exec_util"] == pytest.approx(4e11 / 2.0 / 1e12)  # per-device FLOPs over the window


def _small(kind: str, **changes: object) -> ModelArgs:
    """The debug shapes at dim 64, 3 blocks: dense, MoE, or DeepSeek-V3's latent attention (low-rank
    or full queries; values narrower than the q/k heads)."""
    import dataclasses

    base = PRESETS["moe-debug"] if kind == "moe" else PRESETS["deepseek-debug"] if "deepseek" in kind \
        else PRESETS["debug"]
    mla = dict(q_lora_rank=0 if kind == "deepseek_full_q" else 24, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=6) if "deepseek" in kind else {}
    return dataclasses.replace(base, dim=64, n_layers=3, n_heads=4, vocab_size=256, multiple_of=16,
                               moe_hidden_dim=32, n_experts=0 if kind.startswith("dense") else 4,
                               **{"n_kv_heads": 4 if kind == "dense_mha" or mla else 2, **mla, **changes})


@pytest.mark.parametrize("kind", ["dense_mha", "dense_gqa", "moe", "deepseek", "deepseek_full_q"])
def test_executed_flops_match_torch_flop_counter(kind: str, monkeypatch: pytest.MonkeyPatch):
    """A real forward + backward under FlopCounterMode (with formulas for CPU attention and grouped
    GEMM, which count every query-key pair) equals the analytic count with non-causal pairs. The
    count is the model's: on CPU the experts' groups are padded with zero rows (moe.pad_groups),
    which run as GEMM rows too -- here padded to multiples of one row, i.e. not at all."""

    import shardwise.models.moe as moe

    monkeypatch.setattr(moe, "group_alignment", lambda slots, experts: 1)

    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.models.transformer import init_weights
    from shardwise.observe.flops import executed_flops, flop_counter_formulas

    args = _small(kind)
    model = build_model(args, device="cpu")
    init_weights(model, 0)
    b, s = 2, 32
    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        logits = model(torch.randint(0, 256, (b, s)))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(0, 256, (b * s,))).backward()
    want = executed_flops(args, b * s, pairs=b * s * s)
    got = counter.get_total_flops()
    assert abs(got - want.total) <= 0.01 * want.total, (got, want)
    assert got == pytest.approx(want.total, rel=1e-9)  # in fact exact


def test_attention_pairs_match_the_mask():
    """Causal, sliding-window and document-mask pair counts equal the True entries of the mask."""
    from shardwise.models.transformer import document_mask
    from shardwise.observe.flops import attention_pairs, document_pairs

    s = 37
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    assert attention_pairs(s) == causal.sum()
    assert attention_pairs(s, causal=False) == s * s
    for w in (1, 5, 36, 37, 50):
        window = causal & ~torch.ones(s, s, dtype=torch.bool).tril(-w)
        assert attention_pairs(s, window=w) == window.sum(), w
    doc_ids = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [5] * 37])
    assert document_pairs(doc_ids) == document_mask(doc_ids).sum()


def test_palm_flops_count_each_documents_length():
    """MFU's PaLM figure: without masks ``tokens * flops_per_token``; under document masks the
    attention term counts each document's ``L^2`` (masked-out pairs are no work), so a window of
    many short documents is not credited with a whole window's attention."""
    from shardwise.observe.flops import attention_pairs, attention_width, document_pairs, palm_flops

    args = PRESETS["debug"]
    s = 64
    assert palm_flops(args, 2 * s, 2 * attention_pairs(s)) == pytest.approx(2 * s * flops_per_token(args, s))
    doc_ids = torch.tensor([[0] * 10 + [1] * 54, [0] * 64])
    per_layer = 6.0 * args.n_heads * attention_width(args) * args.n_layers
    want = 2 * s * (flops_per_token(args, s) - per_layer * s) + per_layer * (10**2 + 54**2 + 64**2)
    assert float(palm_flops(args, 2 * s, document_pairs(doc_ids))) == pytest.approx(want)


def test_throughput_mfu_from_model_flops(monkeypatch: pytest.MonkeyPatch):
    """Given each step's PaLM FLOPs (document masks), MFU is their rate over the peak."""
    clock = itertools.chain([0.0], itertools.repeat(2.0))
    monkeypatch.setattr("shardwise.observe.metrics.time.perf_counter", lambda: next(clock))
    t = Throughput(flops_per_token=1e9, peak_tflops=1.0, world_size=2)
    t.add(1000, 3e11, torch.tensor(2e11))
    t.add(1000, 1e11, 2e11)
    assert t.window()["mfu"] == pytest.approx(4e11 / 2.0 / 1e12)


def test_executed_flops_terms():
    """GQA does not reduce attention FLOPs; full recompute adds one forward of the blocks but their
    down projections; MoE counts the top-k experts only."""
    import dataclasses

    from shardwise.observe.flops import executed_flops, matmul_params

    a = PRESETS["debug"]
    gqa = dataclasses.replace(a, n_kv_heads=4)
    f, g = executed_flops(a, 100, 1000), executed_flops(gqa, 100, 1000)
    assert f.attention == g.attention and g.matmul < f.matmul
    full = executed_flops(a, 100, 1000, recompute="full")
    w2 = a.n_layers * a.ffn_hidden_dim * a.dim  # down projections: not recomputed (early stop)
    blocks = 2 * (matmul_params(a) - a.vocab_size * a.dim - w2) * 100
    assert full.matmul - f.matmul == pytest.approx(blocks)
    assert full.attention == pytest.approx(f.attention * 4.5 / 3.5)
    moe = PRESETS["moe-debug"]
    top1 = dataclasses.replace(moe, moe_top_k=1)
    expert = 3 * moe.dim * moe.moe_hidden_dim
    assert matmul_params(moe) - matmul_params(top1) == (moe.n_layers - moe.n_dense_layers) * expert


@pytest.mark.parametrize(("kind", "mode", "chunk"), [("dense", "full", 0), ("moe", "full", 0),
                                                     ("dense", "layer", 0), ("moe", "layer", 16),
                                                     ("dense", "selective", 16),
                                                     ("dense", "selective_half", 0),
                                                     ("moe", "selective_half", 16),
                                                     ("deepseek", "full", 0),
                                                     ("deepseek", "selective_half", 0),
                                                     ("deepseek_full_q", "selective_half", 16)])
def test_executed_flops_with_recompute_match_the_flop_counter(kind: str, mode: str, chunk: int,
                                                              monkeypatch: pytest.MonkeyPatch):
    """Blocks under our activation checkpointing: FlopCounterMode sees one more forward of each
    checkpointed block in backward (less the down projection, which checkpoint's early stop skips;
    none under the selective policy), and the fused loss no head matmul beyond the plain loss's
    three (it computes its gradients in forward): exactly the analytic count; dense and MoE (the
    CPU's expert padding off, as in the test above)."""

    import shardwise.models.moe as moe

    monkeypatch.setattr(moe, "group_alignment", lambda slots, experts: 1)

    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.config.schema import ActivationCheckpointConfig
    from shardwise.models.transformer import init_weights
    from shardwise.observe.flops import executed_flops, flop_counter_formulas
    from shardwise.parallel.ac import apply_ac

    args = _small(kind)
    model = build_model(args, device="cpu")
    init_weights(model, 0)
    apply_ac(model, ActivationCheckpointConfig(mode=mode, every=2))
    b, s = 2, 32
    tokens, labels = torch.randint(0, 256, (b, s)), torch.randint(0, 256, (b, s))
    with FlopCounterMode(display=False, custom_mapping=flop_counter_formulas()) as counter:
        if chunk:
            model(tokens, labels=labels, loss_chunk=chunk).backward()
        else:
            torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    # chunked_loss=False: the summed fused loss recomputes no logits (only the vocab-parallel op does)
    want = executed_flops(args, b * s, pairs=b * s * s, recompute=mode, every=2, chunked_loss=False)
    assert counter.get_total_flops() == pytest.approx(want.total, rel=1e-9)


def test_a_capture_that_would_run_code_is_refused(tmp_path: Path):
    """verify --localize loads each rank's capture: one that unpickles into code is refused in one line
    (it was torch.load(weights_only=False))."""

    from shardwise.config.schema import ConfigError
    from shardwise.observe.capture import localize

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    for run in ("ref", "lay"):
        (tmp_path / run).mkdir()
        torch.save({"rows": [(0, 1)], "outputs": [], "grads": [], "x": Payload()},
                   tmp_path / run / "rank0.pt")
    with pytest.raises(ConfigError, match="refused, since loading it could run code"):
        localize(tmp_path / "ref", tmp_path / "lay", "fp32", "")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("out_tty,err_tty,want", [(True, True, "bar"), (False, True, "line"),
                                                  (True, False, "line"), (False, False, "line")])
def test_auto_log_format_gives_lines_to_a_pipe(out_tty: bool, err_tty: bool, want: str,
                                               monkeypatch: pytest.MonkeyPatch):
    """`shardwise train ... | tee log` keeps a line per step (stdout is the pipe; stderr is still the
    terminal, which alone used to choose the bar: the log got no step lines)."""
    import sys

    from shardwise.config.schema import MetricsConfig
    from shardwise.observe.metrics import console_format

    monkeypatch.setattr(sys.stdout, "isatty", lambda: out_tty, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: err_tty, raising=False)
    assert console_format(MetricsConfig()) == want


def test_collapse_watch_says_a_block_stuck_above_3x_for_10_steps_once():
    from shardwise.observe.experts import CollapseWatch

    watch = CollapseWatch(n_experts=8, top_k=2)
    said = [watch.add(step, {"1": 3.5 if step != 6 else 2.0, "2": 1.2}) for step in range(1, 17)]
    # block 1 dips at step 6, so its 10 steps running end at step 16; block 2 is healthy
    assert [i + 1 for i, s in enumerate(said) if s] == [16]
    assert said[15].startswith("step 16: MoE routing collapsed in block 1: ")
    assert "(now 3.50x; 4x = " in said[15]
    assert all(watch.add(step, {"1": 3.9, "2": 1.2}) is None for step in range(17, 40))  # said once
    watch.add(40, {"1": 1.0, "2": 1.0})  # recovered: a new collapse is said again
    said = [watch.add(step, {"1": 4.0, "2": 4.0}) for step in range(41, 51)]
    assert said[-1].startswith("step 50: MoE routing collapsed in blocks 1, 2: ") and not any(said[:-1])


def test_metrics_log_puts_each_blocks_load_in_tensorboard_and_the_worst_in_the_line(tmp_path, capsys):
    from shardwise.config.schema import MetricsConfig
    from shardwise.observe.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, MetricsConfig(log_format="line", tensorboard=True), 10, 0, True)
    record = {"loss": 4.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s_per_device": 100.0,
              "tokens_per_s": 100.0, "mfu": 0.1, "memory_gib": 1.0, "step_time_s": 1.0, "expert_load": 2.5,
              "expert_load_layers": {"1": 1.5, "3": 2.5}}
    logger.log(1, record)
    logger.close()
    assert "| experts 2.50x |" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["expert_load_layers"] == {"1": 1.5, "3": 2.5}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"expert_load", "expert_load_layers/1", "expert_load_layers/3"} <= set(tags)
    assert events.Scalars("expert_load_layers/3")[0].value == pytest.approx(2.5)


def test_spike_watch_judges_against_the_healthy_recent_mean():
    """A spike is a loss above factor x the mean of the window's non-spike steps before it, judged
    only after warm-up with a full window; spikes stay out of the reference; `window` spikes in a
    row become the new level; a NaN is the non-finite check's, not a spike."""
    from shardwise.observe.spikes import SpikeWatch

    w = SpikeWatch(factor=1.5, window=3, after_step=2)
    verdicts = {step: w.add(step, loss) for step, loss in enumerate([9.0, 30.0, 4.0, 4.0, 4.0], start=1)}
    assert all(v is None for v in verdicts.values())  # steps 1-2: warm-up; 3-5 fill the window
    assert w.limit(6) == pytest.approx(6.0)
    assert w.add(6, 6.0) is None  # at the limit: not a spike
    spike = w.add(7, 9.0)  # mean of 4, 4, 6
    assert spike is not None and spike.step == 7 and spike.ratio == pytest.approx(9 / (14 / 3))
    assert w.limit(8) == pytest.approx(1.5 * 14 / 3)  # the spike stayed out of the reference
    assert w.add(8, float("nan")) is None and w.limit(9) == pytest.approx(7.0)
    assert w.add(9, 5.0) is None and w.limit(10) == pytest.approx(7.5)  # 4, 6, 5
    assert not w.add(10, 20.0).rebased and not w.add(11, 20.0).rebased
    third = w.add(12, 20.0)
    assert third.rebased and "3 spikes in a row" in third.describe(3, ["kjv:1"], skipped=True)
    assert w.limit(13) == pytest.approx(30.0) and w.add(13, 21.0) is None  # the new level
    assert SpikeWatch(0.0, 3, 0).limit(100) == float("inf")  # spike_factor=0: no detection
    line = spike.describe(3, ["kjv:5", "kjv:9"], skipped=False)
    assert line.startswith("step 7: loss spike, 9.0000 is 1.93x the mean of the 3 steps before it (4.6667)")
    assert "its update was applied" in line and "kjv:5, kjv:9" in line


def test_wandb_runs_online_only_when_logged_in_and_says_when_it_is_not(tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch):
    from shardwise.config.schema import MetricsConfig
    from shardwise.resolve.checks import resolve_wandb_mode

    def mode(wanted: str = "auto") -> str:
        m = MetricsConfig(wandb=True, wandb_mode=wanted)
        resolve_wandb_mode(m)
        return m.wandb_mode

    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login a password b\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert mode() == "offline"
    said = capsys.readouterr().out
    assert said.count("notice: metrics.wandb: not logged in to W&B") == 1 and "wandb sync" in said
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")  # `wandb login` writes it
    assert mode() == "online" and capsys.readouterr().out == ""
    netrc.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B's own switch: left to W&B to read
    assert mode() == "auto"
    assert mode("offline") == "offline"  # the user's choice
