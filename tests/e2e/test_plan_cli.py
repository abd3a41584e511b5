"""`estimate`, `plan` and `calibrate` from the command line: what plan writes trains as written, a
given config keeps everything but the layout, and bad input gets one line (exit 2), a model that
fits nowhere an answer saying what would fit (exit 1)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from shardwise.cli import main
from tests.helpers import ROOT, metrics, resolved_config, run_cli

pytestmark = pytest.mark.e2e


def _one_line_error(capsys: pytest.CaptureFixture, rc: int, code: int = 2) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == code and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.slow  # (make test-all: make test keeps within its time on 2 cores)
def test_calibrate_quick_then_plan_trains_on_four_ranks(tmp_path: Path, data_cache: str):
    """The whole local flow of docs/planning.md, as written there (plus the shared token cache, an
    output path and a run directory): a quick calibration, a plan for 4 local ranks of the debug
    preset on it, then the written file trained for 2 steps with the command plan prints."""
    cal = run_cli(["calibrate", "--quick", f"--data.cache_dir={data_cache}"], timeout=600)
    profile = Path(data_cache) / "hardware_local.toml"
    assert f"saved {profile}" in cal.stdout
    hw = tomllib.loads(profile.read_text())
    assert hw["cores"] >= 1 and set(hw["collective_bw_gbs"]) == {"2", "4", "2@4"}
    assert set(hw["shared_compute"]) == set(hw["collective_sync_us"]) == {"2", "4"}
    # (barrier-to-barrier makespans of the same work against it alone: a fraction, never above 1)
    assert all(0.3 < v <= 1.0 for v in hw["shared_compute"].values()), hw["shared_compute"]
    assert hw["overhead_ms"]["per_step"] >= 0.0
    seqs = {k.rsplit(":", 1)[1] for k in hw["thread_tflops"] if k.startswith("attention_")}
    assert seqs == {"256", "512", "1024"}
    # a context-parallel ring's unmasked calls: measured at each causal call's head width and length
    ring = {k[len("ring_"):] for k in hw["thread_tflops"] if k.startswith("ring_attention_")}
    assert ring == {k for k in hw["thread_tflops"] if k.startswith("attention_")}
    assert hw["description"].endswith("--quick") and hw["overhead_ms"]["per_moe_block"] > 0
    assert hw["overhead_ms"]["per_tp_block"] > 0  # DTensor dispatch costs host time per block
    assert 0.2 <= hw["efficiency"]["memory"] <= 1  # from the probe model's real step
    # each collective kind by buffer size (4 and 16 MiB in quick mode), per process count
    assert set(hw["collective_kind_bw_gbs"]) == {f"{k}@{w}:{mib * 2**20}" for k in
                                                 ("all_gather", "reduce_scatter", "all_reduce")
                                                 for w in (2, 4) for mib in (4, 16)}
    assert all(v > 0 for v in hw["collective_kind_bw_gbs"].values())

    out = tmp_path / "plan.toml"
    proc = run_cli(["plan", "--config", "configs/debug.toml", "--nproc", "4", "--hardware", "local",
                    f"--out={out}", f"--data.cache_dir={data_cache}", f"--run.dir={tmp_path / 'run'}"])
    assert "notice: data.path is not set, so this config trains on the shipped 4 MB KJV corpus" in proc.stdout
    command = f"shardwise train --config {out} --nproc 4"
    assert f"best layout written to {out}: {command}" in proc.stdout
    written = tomllib.loads(out.read_text())
    assert written["run"]["device"] == "cpu"  # planned for this machine's ranks, not a GPU
    assert f"# run: {command}\n" in out.read_text() and "# note: data.path is not set" in out.read_text()

    run_cli(command.split()[1:] + ["--training.steps", "2"], timeout=900)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["loss"] < rows[0]["loss"] + 1
    ran = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert ran["parallel"] == written["parallel"]


def test_a_measured_profile_file_plans_for_the_cpu(tmp_path: Path):
    """--hardware takes a profile file: a measured machine's (it has cores) plans for cpu ranks,
    resolving auto settings for the CPU; a GPU profile for cuda."""
    from shardwise.plan.hardware import PROFILE_DIR, profile_device

    local = tmp_path / "mine.toml"
    local.write_text((PROFILE_DIR / "h100.toml").read_text().replace("comm_overlap = true",
                                                                    "comm_overlap = false\ncores = 2"))
    assert profile_device(str(local)) == "cpu" and profile_device("local") == "cpu"
    assert profile_device(str(PROFILE_DIR / "h100.toml")) == "cuda" and profile_device("h100") == "cuda"


# Everything plan may change: the layout, the memory switches, and (from --seq / the default
# batch) the sequence and the batch; run.device and the precision resolve for the planned device.
PLAN_CHANGES = {"parallel", "activation_checkpoint", "training.micro_batch", "training.seq_len",
                "training.global_batch", "model.max_seq_len", "run.device", "training.mixed_precision"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_plan_keeps_the_given_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """plan --config: data (a chat set with a tokenizer folder), optimizer, checkpoint, metrics...
    come through unchanged; only the layout keys differ. No notice about the shipped corpus."""
    mine = tmp_path / "mine.toml"
    chats = ROOT / "shardwise" / "data" / "assets" / "kjv_chat.jsonl.gz"
    mine.write_text(f"""[run]\ndir = "{tmp_path / 'runs'}"\n[model]\nname = "debug"\n
[data]\npath = "{chats}"\nformat = "chat"\ndocument_mask = true\nval_fraction = 0.05\n
[training]\nsteps = 40\nseq_len = 512\nglobal_batch = 16\n
[optimizer]\nlr = 1.25e-4\nstate_dtype = "bf16"\nweight_decay = 0.05\n
[lr_scheduler]\nwarmup_steps = 4\n[checkpoint]\ninterval = 17\nkeep_latest_k = 3\n""")
    base = resolved_config(str(mine), device="cuda")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", str(mine), "--nproc", "8", "--hardware", "h100"]) == 0
    assert "data.path is not set" not in capsys.readouterr().out
    written, given = _flat(tomllib.loads((tmp_path / "plan.toml").read_text())), _flat(base.to_dict())
    changed = {k for k in set(written) | set(given) if written.get(k) != given.get(k)}
    assert changed and all(k in PLAN_CHANGES or k.split(".")[0] in PLAN_CHANGES for k in changed), changed
    for section in ("data", "optimizer", "checkpoint", "lr_scheduler", "model"):
        keys = {k for k in given if k.startswith(section + ".") and k != "model.max_seq_len"}
        assert {k: written[k] for k in keys} == {k: given[k] for k in keys}, section


def test_plan_verify_writes_only_a_layout_that_passes_on_simulated_ranks(tmp_path: Path, data_cache: str):
    """``plan --verify`` trains its first choice as simulated ranks against one rank before writing
    it: the debug preset's plan for 4 H100s passes and is written; with one FSDP unit's gradients
    reduced at twice their scale (planted) the same layout fails and nothing is written (exit 1)."""
    args = ["plan", "--config", "configs/debug.toml", "--nproc", "4", "--hardware", "h100", "--verify",
            f"--data.cache_dir={data_cache}"]
    ok = run_cli([*args, "--out", str(tmp_path / "ok.toml")], timeout=600)
    layout = re.search(r"^plan --verify: (\S+) as 4 simulated ranks", ok.stdout, re.M)
    assert layout and "dp_shard" in layout[1], ok.stdout
    assert re.search(rf"^\| {re.escape(layout[1])} \| 4 \|.*\| PASS \|$", ok.stdout, re.M), ok.stdout
    assert (tmp_path / "ok.toml").exists()
    assert f"logs and runs under {tmp_path / 'ok-verify' / 'runs'}" in ok.stdout  # (kept beside the plan)
    assert (tmp_path / "ok-verify" / "runs" / "loss_overlay.png").exists()
    bad = run_cli([*args, "--out", str(tmp_path / "bad.toml")], timeout=600, check=False,
                  fault="fsdp_unit_grad_scale")
    assert bad.returncode == 1 and re.search(r"\| 4 \|.*\| FAIL \|$", bad.stdout, re.M), bad.stdout
    assert "no plan written" in bad.stderr and not (tmp_path / "bad.toml").exists()


def test_estimate_writes_its_json(tmp_path: Path, capsys):
    out = tmp_path / "est.json"
    assert main(["estimate", "--config", "configs/debug.toml", "--nproc", "4", "--parallel.pp", "2",
                 "--parallel.tp", "2", "--hardware", "h100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pp rank 0" in text and "pp rank 1" in text and "pipeline bubble" in text
    data = json.loads(out.read_text())
    assert data["world"] == 4 and len(data["memory"]) == 2 and data["time"]["step_s"] > 0
    assert {r["mesh_dim"] for r in data["comm"]} >= {"tp", "pp"}


@pytest.mark.parametrize("argv, match", [
    (["estimate", "--config", "configs/debug.toml", "--nproc", "3", "--parallel.tp", "2"],
     "world size 3 is not divisible"),
    (["estimate", "--config", "configs/debug.toml", "--nproc", "0"], "--nproc must be >= 1"),
    (["estimate", "--config", "configs/debug.toml", "--nproc", "2", "--hardware", "h1000"],
     "unknown hardware"),
    (["estimate", "--config", "configs/debug.toml", "--nproc", "2", "--hardware", "nothere.toml"],
     "does not exist"),
    (["plan", "--model", "8b", "--nproc", "8", "--hardware", "h1000"], "unknown hardware 'h1000'"),
    (["plan", "--model", "8b", "--nproc", "0"], "--nproc must be >= 1"),
    (["plan", "--model", "8b", "--nproc", "1", "--verify"], "--verify trains the plan's layout"),
    (["plan", "--model", "80b", "--nproc", "8"], "model"),
    (["plan", "--model", "8b", "--nproc", "8", "--ac", "most"], "--ac: unknown most"),
    (["plan", "--model", "8b", "--nproc", "8", "--global-batch-tokens", "lots"], "global-batch-tokens"),
    (["plan", "--model", "8b", "--nproc", "8", "--seq", "8192", "--global-batch-tokens", "12000"],
     "multiple of --seq"),
    (["calibrate", "--nonsense"], "unknown flag '--nonsense' for 'shardwise calibrate'"),
])
def test_bad_input_gets_one_line(argv: list[str], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys):
    monkeypatch.chdir(ROOT)
    rc = main(argv + ([] if argv[0] != "plan" else ["--out", str(tmp_path / "p.toml")]))
    err = _one_line_error(capsys, rc)
    assert match in err, err
    assert not (tmp_path / "p.toml").exists()


def test_a_model_that_fits_nowhere_says_what_would(tmp_path: Path, capsys):
    """405B at 8192 tokens on one node: exit 1, one line with the least memory any layout needs and
    the device count it fits on -- which a second plan confirms."""
    rc = main(["plan", "--model", "405b", "--nproc", "8", "--hardware", "h100", "--seq", "8192",
               "--out", str(tmp_path / "p.toml")])
    err = _one_line_error(capsys, rc, code=1)
    assert err.startswith("no layout of 405b fits on 8 x h100 (72.0 GiB usable per device): the least "
                          "memory is"), err
    n = int(err.split("it fits on ")[1].split(" x ")[0])
    assert n > 8 and not (tmp_path / "p.toml").exists()
    assert main(["plan", "--model", "405b", "--nproc", str(n), "--hardware", "h100", "--seq", "8192",
                 "--out", str(tmp_path / "p.toml")]) == 0
    assert main(["plan", "--model", "405b", "--nproc", str(n // 2), "--hardware", "h100", "--seq", "8192",
                 "--ac", "full", "--schedules", "1f1b", "--out", ""]) == 1


def test_nothing_accepted_says_the_trainers_reason(capsys):
    """7 devices and a batch of 8 sequences of the debug model: no degree fits the shapes; the
    answer is the trainer's own refusal, not a memory verdict."""
    rc = main(["plan", "--config", "configs/debug.toml", "--nproc", "7", "--hardware", "h100",
               "--global-batch-tokens", "4096", "--out", ""])
    err = _one_line_error(capsys, rc, code=1)
    assert err.startswith("no layout of debug on 7 x h100 is accepted: "), err


def test_plan_for_a_preset_plans_its_published_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys):
    """The pretraining journey's first half, as documented: `plan --model 8b --nproc 8 --hardware h100`
    plans configs/8b.toml's shape (sequence 8192, 16 sequences, bf16 + float8) and says so; the
    written TOML, estimated on the same GPUs, is the same shape and layout at the same speed; training
    it without the Llama 3 tokenizer is refused in one line naming both sizes and the fix."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "8b", "--nproc", "8", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    shape = ("model 8b (8.03B params), sequence 8,192, 16 sequences = 131,072 tokens per step, bf16 + "
             "float8 linears (tensorwise)")
    assert out.startswith(shape)
    assert "notice: --model 8b: starting from 8b.toml" in out
    assert "8b trains with the Llama 3 tokenizer: run the written config with --data.tokenizer DIR" in out
    best = next(line for line in out.splitlines() if line.startswith("| 1 |")).split(" | ")
    written = tomllib.loads((tmp_path / "plan.toml").read_text())
    assert (written["training"]["seq_len"], written["training"]["global_batch"]) == (8192, 16)
    assert main(["estimate", "--config", "plan.toml", "--nproc", "8", "--hardware", "h100"]) == 0
    est = capsys.readouterr().out
    assert est.startswith(shape) and f"layout {best[1]} on 8 ranks" in est
    assert f"tokens/s, {best[2]} per device" in est
    # another shape is said
    assert main(["plan", "--model", "8b", "--nproc", "8", "--hardware", "h100", "--seq", "4096",
                 "--out", ""]) == 0
    assert "differs from 8b.toml's (sequence 8,192, 16 sequences per step)" in capsys.readouterr().out
    code = main(["train", "--config", "plan.toml", "--run.dir", str(tmp_path / "run"),
                 "--parallel.dp_shard=-1", "--run.device=cpu"])  # (here: one CPU rank)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert ("model 8b has a vocabulary of 128,256 but data.tokenizer (the shipped tokenizer) has 2,048 "
            "tokens: train it with its Llama 3 tokenizer, --data.tokenizer DIR") in err


def test_output_piped_into_head_ends_quietly():
    """`shardwise plan ... | head -1`: the reader goes (here before the first line, so every write
    finds the pipe closed); no traceback follows."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "shardwise", "plan", "--model", "8b", "--nproc", "8",
                          "--hardware", "h100", "--out", ""], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # as head does once it has its line
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
