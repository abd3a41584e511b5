"""Every command line shown in README.md and docs/*.md runs as written.

The commands are read out of the fenced code blocks. Each has an entry in :data:`HOW` saying how it
is checked; a command added to the docs without one fails the first test below, and so does an entry
whose command left the docs.

A command runs in a scratch directory (``configs/``, ``examples/`` and ``bench/`` linked in), with
the repository's environment first on PATH, exactly as typed plus a few appended overrides that
keep it short -- later overrides win, so ``--training.steps 500`` becomes 2 -- and point its outputs
and the token cache into the scratch directory. The cheap ones run in ``make test``; the long ones
(layout matrices, calibration, benchmarks) and those whose path another ``make test`` test already
runs (``covered``: the 4-rank layouts, torchrun, verify, report, the HF round trip) run as written in
``make test-all``, which keeps ``make test`` within its 30 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT, cli_env, need, run_cli

pytestmark = pytest.mark.e2e

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"(shardwise|torchrun|make|sbatch|python|srun|pip)\s")
TRAIN = "--training.steps 2"  # appended to training commands (the last value of a key wins)
VERIFY = "--steps 2"


def documented_commands() -> dict[str, str]:
    """Each command line in a fenced block of the docs (continuations joined, trailing comment
    dropped) -> the first file that shows it."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for block in re.findall(r"```[^\n]*\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line.strip())
                if _COMMAND.match(line + " ") and not line.startswith("shardwise: "):
                    found.setdefault(" ".join(line.split()), doc.name)
    return found


@dataclass(frozen=True)
class Check:
    """How a documented command is checked: ``run`` it (with ``extra`` appended, after ``setup``
    commands in the same scratch directory), in ``make test`` or only in ``make test-all``
    (``slow``, or ``covered``: a test in ``make test``, ``file::name``, runs the same code path --
    the same layout, launcher or tool -- and the command as written runs in ``make test-all``); or
    not run here, for the stated ``reason`` (another test runs the same command, or it needs what
    this machine has not got). Its output must match each pattern in ``shows`` (default: the
    command's own in :data:`SHOWS`); a ``file`` group names a path the command made."""

    extra: str = ""
    setup: tuple[str, ...] = ()
    shows: tuple[str, ...] = ()
    slow: bool = False
    reason: str = ""
    needs: str = ""
    covered: str = ""

    @property
    def runs(self) -> bool:
        return not self.reason

    @property
    def long(self) -> bool:
        return self.slow or bool(self.covered)


def covered(by: str, check: Check | None = None) -> Check:
    """``check`` (default: a short training run), run as written in ``make test-all`` only; ``by``
    runs the same path in ``make test``."""
    return dataclasses.replace(check or train(), covered=by)


def train(run_dir: str = "") -> Check:
    return Check(f"{TRAIN}" + (f" --run.dir {run_dir}" if run_dir else ""))


_CORPUS = f"zcat {ROOT / 'shardwise/data/assets/kjv.jsonl.gz'} > corpus.jsonl"  # a user's own jsonl
_TINY_VERIFY = Check(VERIFY, slow=True)  # layout matrices of 5-8 layouts each: make test-all
_DEBUG_RUN = "shardwise train --config configs/debug.toml --training.steps 2 --eval.interval 0"
_PARITY = "tests/distributed/test_parity.py::test_layout_matches_single_rank"
_HF = "tests/e2e/test_cli.py::test_hf_folder_to_training_and_back_with_no_model_flags"
_PRETRAIN = "tests/e2e/test_journeys.py::test_pretraining_plan_train_lose_a_rank_resume"
_PLAN_DEBUG = "shardwise plan --model debug --nproc 2 --hardware h100 --out plan-debug.toml"
_SFT = ("tests/e2e/test_journeys.py::"
        "test_chat_fine_tuning_from_a_hub_id_to_a_model_transformers_chats_with")
_LOGIN = ("tests/e2e/test_journeys.py::"
          "test_a_login_node_downloads_and_a_compute_node_trains_and_generates_offline")
_EVAL = "tests/e2e/test_eval.py::test_eval_scores_a_checkpoint_as_training_does"
_LORA = "tests/e2e/test_lora_journey.py::test_lora_from_a_base_keeps_it_resumes_exactly_and_exports_merged"
_BASE_100 = "shardwise train --config configs/debug.toml --run.dir runs/base --eval.interval 0"
_LORA_RUN = (_BASE_100, "shardwise train --config configs/debug.toml --checkpoint.path "
                        "runs/base/checkpoints/step-100 --lora.rank 8 --run.dir runs/lora --training.steps 2")
_LORA_FOLDERS = (*_LORA_RUN, "shardwise convert --to-hf runs/base --out base-hf/",
                 "shardwise convert --to-hf runs/lora --out lora-adapter/ --adapter")
_TRACE = "tests/e2e/test_trace.py::test_two_runs_are_bitwise_equal_and_compare_finds_a_planted_change"
_SMOKE = ("shardwise train --config configs/debug.toml --training.steps 2 --run.dir runs/smoke "
          "--eval.interval 0")

HOW: dict[str, Check] = {
    "make run": Check(reason="the main job: tests/e2e/test_cli.py::test_main_job_short_schedule runs its "
                             "config (configs/debug.toml, run.overwrite) on a 20-step schedule"),
    "make test": Check(reason="this test suite itself (CI runs it through .ci/run)"),
    "pip install -e .": Check(reason="installs into the environment it runs in; make run installs the same "
                                     "runtime set into .venv, and tests/unit/test_packaging.py imports "
                                     "every module with that set alone"),
    "pip install -e \".[float8,parquet,wandb,mlflow,eval]\"": Check(
        reason="installs into the environment it runs in; make test installs these extras with [dev] "
               "(test_packaging.py checks [dev] holds each)"),
    "shardwise verify --config configs/debug.toml --nproc 4": covered(
        "tests/e2e/test_verify.py::test_verify_passes_real_layouts_and_catches_a_wrong_one", Check(VERIFY)),
    "shardwise train --config configs/debug.toml --training.steps 5 --run.dir runs/smoke": Check(
        reason="tests/e2e/test_first_commands.py::test_a_five_step_smoke_run runs it as typed"),
    # (the layouts' parity tests train them on 2-4 ranks against one rank: fsdp2, hsdp2x2, fsdp2_tp2)
    "shardwise train --config configs/debug.toml --nproc 4 --parallel.dp_shard 4 "
    "--run.dir runs/fsdp4": covered(_PARITY),
    "shardwise train --config configs/debug.toml --nproc 4 --parallel.dp_replicate 2 "
    "--run.dir runs/hsdp": covered(_PARITY),
    "shardwise train --config configs/debug.toml --nproc 4 --parallel.tp 2 --run.dir runs/tp2":
        covered(_PARITY),
    "shardwise train --config configs/debug.toml --nproc 2 --parallel.pp 2 --run.dir runs/pp2": Check(
        reason="tests/e2e/test_first_commands.py::test_pipeline_on_two_ranks_picks_its_micro_batch runs it "
               "(3 steps)"),
    "shardwise verify --config configs/debug.toml --ranks 64 --layouts pp=2,dp_replicate=2,dp_shard=2,tp=8 "
    "--steps 2 --training.mixed_precision=fp32": covered(
        "tests/distributed/test_simulated.py::test_verify_ranks_64_passes_the_debug_presets_widest_layout",
        Check(VERIFY)),
    "shardwise train --config configs/debug.toml --data.synthetic=true --model.vocab_size=4096 "
    "--run.dir runs/synthetic": covered(
        "tests/e2e/test_synthetic_run.py::"
        "test_a_synthetic_run_trains_over_the_whole_vocabulary_and_resumes_exactly"),
    "shardwise verify --config configs/405b.toml --ranks 64 --shrink --layouts pp=8,tp=8 --steps 2 "
    "--data.synthetic=true --training.seq_len=64 --training.global_batch=8 "
    "--training.mixed_precision=fp32": Check(
        slow=True, shows=(r"\| pp=8,tp=8,dp_shard=1 \| 64 \|.*\| PASS \|",)),
    # (MoE on simulated ranks: the EP x TP twin of the real processes runs in make test)
    "shardwise verify --config configs/deepseek-debug.toml --ranks 8 --layouts pp=2,dp_shard=4,ep=4 "
    "--steps 2 --training.mixed_precision=fp32": covered(
        "tests/distributed/test_simulated.py::"
        "test_simulated_ranks_train_what_the_real_processes_of_the_layout_train", Check(VERIFY)),
    # (localized on simulated ranks: the same layouts with HSDP's replicate all-reduce planted away)
    "shardwise verify --config configs/debug.toml --ranks 8 --layouts dp_shard=8 dp_replicate=2,dp_shard=4 "
    "--steps 2 --training.mixed_precision=fp32 --localize": covered(
        "tests/distributed/test_simulated.py::"
        "test_a_gradient_never_summed_over_dp_replicate_fails_hsdp_and_only_hsdp",
        Check(VERIFY, shows=(r"dp_shard=8: every module output and gradient of step 1 agrees",
                     r"dp_replicate=2,dp_shard=4: every module output and gradient of step 1 agrees"))),
    # (the narrowed model's overrides are the unit test's; verify --ranks over TP x FSDP the 64-rank one's)
    "shardwise verify --config configs/debug.toml --ranks 8 --shrink --layouts dp_shard=2,tp=4 --steps 2 "
    "--training.mixed_precision=fp32": covered(
        "tests/unit/test_simulate.py::test_shrink_keeps_what_decides_the_layout_and_divides_the_widths",
        Check(VERIFY)),
    "shardwise verify --config configs/debug.toml --layouts dp_shard=4 tp=2,dp_shard=2": covered(
        "tests/e2e/test_verify.py::test_verify_passes_real_layouts_and_catches_a_wrong_one", Check(VERIFY)),
    "torchrun --standalone --nproc-per-node 4 -m shardwise train --config configs/debug.toml "
    "--run.dir runs/torchrun": covered("tests/distributed/test_parity.py::test_torchrun_entry_point"),
    "shardwise train --config configs/debug.toml --activation_checkpoint.mode selective "
    "--compile.enabled true --float8.enabled true --optimizer.state_dtype bf16 --training.loss_chunk 1024 "
    "--run.dir runs/lean": covered(
        "tests/distributed/test_precision_layouts.py::test_compile_with_checkpointing_matches_single_rank"),
    "sbatch examples/slurm.sbatch configs/debug.toml": Check(
        reason="needs a Slurm cluster; test_multinode.py runs the script through stand-in srun/scontrol"),
    # (the trainer's fp32 path is the main job's here; the WSD schedule: tests/unit/test_optim.py)
    "shardwise train --config configs/debug.toml --training.steps 500 --training.mixed_precision fp32 "
    "--optimizer.lr 1e-3 --lr_scheduler.decay wsd --run.dir runs/mine": covered(
        "tests/e2e/test_cli.py::test_main_job_short_schedule"),
    "shardwise train --config configs/debug.toml --print-config": Check(),
    "shardwise train --help-config": Check(),
    "shardwise estimate --config configs/debug.toml --nproc 4 --parallel.tp 2 --hardware h100": Check(),
    "shardwise plan --model 70b --nproc 256 --hardware h100 --seq 8192 --global-batch-tokens 4M": Check(),
    "shardwise calibrate": Check(slow=True),  # two to five minutes of measurements
    # docs/checkpointing.md, run as one sequence: export the run `make run` leaves (its step-100 stood in
    # for by a 2-step run's checkpoint), import it back, train from it.
    "shardwise convert --to-hf runs/debug/checkpoints/step-100 --out hf/ --dtype bf16": Check(
        reason="runs as the first step of the sequence below"),
    "shardwise convert --from-hf hf/ --out init/step-0": Check(
        reason="runs as the second step of the sequence below"),
    "shardwise train --config init/step-0.toml --run.dir runs/from-hf": covered(_HF, Check(TRAIN, setup=(
        _DEBUG_RUN, "mv runs/debug/checkpoints/step-2 runs/debug/checkpoints/step-100",
        "shardwise convert --to-hf runs/debug/checkpoints/step-100 --out hf/ --dtype bf16",
        "shardwise convert --from-hf hf/ --out init/step-0"))),
    # docs/parallelism.md: traces
    "shardwise train --config configs/debug.toml --debug.deterministic true --debug.trace runs/a.trace "
    "--run.dir runs/a": covered(_TRACE),
    "shardwise train --config configs/debug.toml --debug.deterministic true --debug.trace runs/b.trace "
    "--run.dir runs/b": covered(_TRACE),
    "shardwise compare runs/a.trace runs/b.trace": covered(_TRACE, Check(setup=tuple(
        f"shardwise train --config configs/debug.toml --debug.deterministic true "
        f"--debug.trace runs/{x}.trace --run.dir runs/{x} {TRAIN} --eval.interval 0" for x in "ab"))),
    # docs/observability.md
    "shardwise report runs/debug": covered("tests/distributed/test_report.py::test_report_of_two_real_runs",
                                           Check(setup=(_DEBUG_RUN,))),
    "shardwise report runs/smoke runs/fsdp4 --out runs/compare --screenshot": covered(
        "tests/distributed/test_report.py::test_report_screenshot_in_headless_chromium", Check(
            needs="chromium", setup=(_SMOKE, "shardwise train --config configs/debug.toml --training.steps 2 "
                                             "--eval.interval 0 --nproc 4 --parallel.dp_shard 4 "
                                             "--run.dir runs/fsdp4"))),
    # docs/parallelism.md: the layout matrices behind its tables
    "shardwise verify --config configs/debug.toml --layouts dp_shard=4 tp=2,dp_shard=2 "
    "--steps 20": _TINY_VERIFY,
    # docs/planning.md: benchmarks (their output is BENCHMARKS.md's)
    "python bench/plan_accuracy.py --calibrate": Check(
        reason="a long benchmark (calibration, then 14 layouts run for real); BENCHMARKS.md has its output"),
    "python bench/published.py --plan": Check(slow=True),
    "python bench/published.py --fit": covered(
        "tests/unit/test_plan_gpu.py::test_published_rows_fitted_on_8b_and_predicted_beyond", Check()),
    "python bench/gpu_model.py --hardware h100 --only-attention --out h100_attention.json": Check(
        reason="needs a CUDA GPU; BENCHMARKS.md has its output (one H100 and one H200, 2026-11-26)"),
    "python bench/gpu_model.py --fit-attention bench/results/h100_attention.json": Check(),
    "python bench/gpu_model.py --step-kernels bench/results/h100_1b_4x2048_kernels.json": Check(),
    "python bench/plan_ranking.py --calibrate": Check(
        reason="a long benchmark (calibration, then 6 layouts trained for real 3 times); BENCHMARKS.md has "
               "its output"),
    "python bench/plan_ranking.py --set moe": Check(reason="a long benchmark; BENCHMARKS.md has its output"),
    "python bench/plan_ranking.py --report bench/results/ranking_avx2_moe_2026-11-26.json": Check(),
    "python bench/plan_ranking.py --set 125m --steps 8": Check(
        reason="a long benchmark; BENCHMARKS.md has its output"),
    # docs/planning.md, the local flow: tests/e2e/test_plan_cli.py runs these three in this order
    "shardwise calibrate --quick": Check(reason="test_plan_cli.py runs it, then the two commands below"),
    "shardwise plan --config configs/debug.toml --nproc 4 --hardware local": Check(
        reason="test_plan_cli.py runs it on the profile calibrate --quick wrote"),
    "shardwise train --config plan.toml --nproc 4 --training.steps 20": Check(
        reason="test_plan_cli.py trains the written plan.toml with the command plan prints"),
    # docs/models.md: DeepSeek-V3
    "shardwise train --config configs/deepseek-debug.toml --nproc 4 --parallel.ep 2 --parallel.tp 2": covered(
        "tests/distributed/test_parity.py::test_deepseek_layout_matches_single_rank"),
    "shardwise verify --config configs/deepseek-debug.toml --nproc 4 --steps 10 "
    "--training.mixed_precision fp32": covered(
        "tests/e2e/test_verify.py::test_deepseek_verify_passes_its_standard_layouts", Check(VERIFY)),
    "shardwise estimate --config configs/deepseek-v3-16b.toml --nproc 8 --hardware h100": Check(),
    "shardwise plan --model deepseek-v3-671b --nproc 512 --hardware h100 --seq 4096": Check(slow=True),
    # docs/data.md
    "shardwise train --config configs/chat-debug.toml": covered(
        "tests/e2e/test_cli.py::test_fine_tuning_on_chat_data_lowers_the_assistant_loss"),
    "shardwise prepare --config configs/debug.toml": Check(),
    "shardwise prepare --config configs/debug.toml --data.path corpus.jsonl --data.prepared_dir prepared":
        Check(setup=(_CORPUS,)),
    # (training on a user's own jsonl: the mixed-source resume test trains on one, prepared)
    "shardwise train --config configs/debug.toml --data.path corpus.jsonl --data.prepared_dir prepared":
        covered("tests/distributed/test_parity.py::test_resume_continues_the_same_run", Check(
            TRAIN, setup=(_CORPUS, "shardwise prepare --config configs/debug.toml --data.path corpus.jsonl "
                                   "--data.prepared_dir prepared"))),
    # docs/pretraining.md: the GPU commands, then the same journey on CPU ranks
    "shardwise plan --model 8b --nproc 8 --hardware h100": Check(),
    "shardwise estimate --config plan.toml --nproc 8 --hardware h100": Check(
        setup=("shardwise plan --model 8b --nproc 8 --hardware h100",)),
    "torchrun --nproc-per-node 8 -m shardwise train --config plan.toml --data.path DATA --data.tokenizer TOK":
        Check(reason="needs 8 GPUs and the Llama 3 tokenizer; test_plan_cli.py::"
                     "test_plan_for_a_preset_plans_its_published_shape runs the plan, estimates it and "
                     "checks the refusal without the tokenizer"),
    "torchrun --nproc-per-node 8 -m shardwise train --config plan.toml --data.path DATA --data.tokenizer TOK "
    "--checkpoint.resume true": Check(reason="needs 8 GPUs; test_journeys.py resumes the CPU rehearsal"),
    "shardwise plan --model debug --nproc 2 --hardware h100 --out plan-debug.toml": Check(),
    "shardwise train --config plan-debug.toml --run.device cpu --nproc 2 --run.dir runs/pretrain": covered(
        _PRETRAIN, Check(TRAIN, setup=(_PLAN_DEBUG,))),
    "shardwise train --config plan-debug.toml --run.device cpu --nproc 2 --run.dir runs/pretrain "
    "--checkpoint.resume true": covered(_PRETRAIN, Check(TRAIN, setup=(
        _PLAN_DEBUG, "shardwise train --config plan-debug.toml --run.device cpu --nproc 2 "
                     "--run.dir runs/pretrain --training.steps 1"))),
    # docs/fine-tuning.md, docs/hub.md: Hub ids, which this machine cannot reach (the tests serve them)
    "shardwise train --checkpoint.initial_hf Qwen/Qwen3-0.6B --data.format chat --data.path chats.jsonl "
    "--run.dir runs/sft": Check(reason=f"reads Qwen/Qwen3-0.6B from the Hub; {_SFT} runs it as written on "
                                       "a tiny Qwen3 that transformers makes, from a cache filled under that "
                                       "id, offline"),
    "shardwise train --checkpoint.initial_hf Qwen/Qwen3-0.6B --data.format chat "
    "--data.path chats.jsonl": Check(reason=f"the command above without --run.dir; {_SFT}"),
    "shardwise convert --to-hf runs/sft/checkpoints/step-100 --out sft-hf/": Check(
        reason=f"exports the run above; {_SFT} exports its own"),
    "shardwise train --config configs/sft-qwen3.toml --checkpoint.initial_hf Qwen/Qwen3-0.6B "
    "--data.path chats.jsonl": Check(
        reason=f"reads Qwen/Qwen3-0.6B from the Hub; {_SFT} fine-tunes a tiny Qwen3 and checks the notice "
               "naming this preset; tests/unit/test_config.py loads the preset and fits it on a GPU"),
    "shardwise train --config configs/sft-qwen3.toml --checkpoint.initial_hf Qwen/Qwen3-0.6B "
    "--data.path hf://datasets/ORG/NAME": Check(
        reason=f"a placeholder dataset id; {_LOGIN} trains from a Hub chat dataset's parquet files"),
    "shardwise train --config configs/sft-qwen3.toml --checkpoint.initial_hf Qwen/Qwen3-0.6B "
    "--data.path chats.jsonl --lora.rank 16 --lora.alpha 32 --optimizer.lr 2e-4": Check(
        reason=f"reads Qwen/Qwen3-0.6B from the Hub; {_SFT} starts from an HF id as this does, and "
               f"{_LORA} trains LoRA from a base as this does"),
    "shardwise train --config configs/debug.toml --run.dir runs/base": covered(_LORA),
    "shardwise train --config configs/debug.toml --checkpoint.path runs/base/checkpoints/step-100 "
    "--lora.rank 8 --run.dir runs/lora": covered(_LORA, Check(TRAIN, setup=(_BASE_100,))),
    "shardwise convert --to-hf runs/lora --out lora-hf/": covered(_LORA, Check(setup=_LORA_RUN)),
    "shardwise convert --to-hf runs/base --out base-hf/": covered(_LORA, Check(setup=(_BASE_100,))),
    "shardwise generate --hf base-hf/ --adapter lora-adapter/ --prompt \"In the beginning\"": covered(
        _LORA, Check(setup=_LORA_FOLDERS)),
    "shardwise train --config configs/debug.toml --checkpoint.initial_hf base-hf/ "
    "--checkpoint.initial_adapter lora-adapter/ --run.dir runs/lora-2": covered(
        _LORA, Check(TRAIN, setup=_LORA_FOLDERS)),
    "shardwise convert --to-hf runs/lora --out lora-adapter/ --adapter": covered(_LORA, Check(
        setup=_LORA_RUN, shows=(r"exported \S+ -> (?P<file>\S+) \(its LoRA adapters as a PEFT folder",))),
    "shardwise generate --hf Qwen/Qwen3-0.6B --prompt \"In the beginning\"": Check(
        reason=f"reads the Hub; {_LOGIN} generates from a downloaded id offline"),
    "shardwise convert --from-hf Qwen/Qwen3-0.6B --out ckpt/qwen3": Check(
        reason=f"reads the Hub; {_LOGIN} converts a downloaded id offline"),
    "shardwise chat --hf Qwen/Qwen3-0.6B": Check(
        reason="interactive, and reads the Hub; tests/e2e/test_chat_command.py talks with a tiny Qwen3 "
               "in a pty"),
    "shardwise chat --checkpoint runs/sft --system \"Answer briefly.\" --temperature 0.7 --top-p 0.9 "
    "--stats": Check(reason="interactive; tests/e2e/test_chat_command.py runs chat with --stats in a pty"),
    "shardwise download Qwen/Qwen3-0.6B": Check(
        reason=f"reads the Hub; {_LOGIN} downloads a model from a local server that answers as the Hub does"),
    "shardwise download hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT": Check(
        reason=f"reads the Hub; {_LOGIN} downloads a dataset folder from the local server"),
    "shardwise prepare --config configs/chat-debug.toml": Check(),
    "shardwise prepare --config configs/debug.toml --show-window kjv:1332": Check(),
    "shardwise train --config configs/chat-debug.toml --training.epochs 2 --run.dir runs/chat-epochs":
        covered("tests/e2e/test_cli.py::test_epochs_set_the_steps_from_the_prepared_data"),
    "shardwise train --config configs/chat-debug.toml --nproc 2 --parallel.cp 2 --training.seq_len 2048 "
    "--run.dir runs/chat-cp2": covered("tests/e2e/test_verify.py::"
                                      "test_verify_passes_on_chat_data_under_fsdp_tp_cp_and_pp"),
    "shardwise convert --from-hf DeepSeek-V3/ --out ds-v3": Check(
        reason="needs DeepSeek-V3's published weights (about 700 GB); tests/unit/test_convert.py::"
               "test_block_fp8_folder_imports_as_its_dequantized_weights imports a block-quantized one"),
    # docs/inspecting.md
    "shardwise generate --checkpoint runs/debug --prompt \"And God said\"": covered(
        _HF, Check(setup=(_DEBUG_RUN,))),
    "shardwise generate --checkpoint runs/debug --prompt \"And God said\" --temperature 0.8 --top-p 0.95 "
    "--seed 1": covered("tests/unit/test_generate.py::test_sampling_through_the_command_line_is_seeded",
                        Check(setup=(_DEBUG_RUN,))),
    "shardwise generate --hf sft-hf/ --messages conversation.json": Check(
        reason=f"needs the fine-tuned folder of docs/fine-tuning.md; {_SFT} runs it on its own"),
    "shardwise eval --checkpoint runs/debug": covered(_EVAL, Check(setup=(_DEBUG_RUN,))),
    "shardwise eval --checkpoint runs/debug --data.path corpus.jsonl": covered(
        _EVAL, Check(setup=(_DEBUG_RUN, _CORPUS))),
    "shardwise eval --checkpoint runs/debug --nproc 2 --parallel.tp 2": covered(
        _EVAL, Check(setup=(_DEBUG_RUN,))),
    "shardwise eval --checkpoint runs/debug --tasks my_task --tasks-path tasks/": Check(
        reason="tasks/ is your own folder of task files; tests/e2e/test_eval.py::"
               "test_lm_eval_scores_a_checkpoint_as_its_hf_backend_scores_the_export runs eval --tasks on "
               "two"),
    "shardwise eval --checkpoint runs/debug --tasks my_task --tasks-path tasks/ --nproc 2 "
    "--batch-size 32": Check(
        reason="tasks/ is your own folder of task files; tests/e2e/test_eval.py::"
               "test_lm_eval_tasks_on_two_ranks_score_as_on_one runs two local tasks on 2 ranks, batched"),
}


_TRAINED = (r"step (\d+)/\1 \| loss \d", r"run directory: (?P<file>\S+) ")  # (its last step)
SHOWS: list[tuple[str, tuple[str, ...]]] = [
    # (a command's start, what its output must hold): the first start that matches decides
    (r"shardwise train .*--print-config", (r"(?m)^\[training\]$", r"(?m)^steps = \d+$")),
    (r"shardwise train --help-config", (r"--training\.steps +\(int, default \d+\)",)),
    (r"shardwise train |torchrun .*-m shardwise train ", _TRAINED),
    (r"shardwise verify ", (r"\| PASS \|",)),
    (r"shardwise estimate ", (r"step [\d.]+ s -> [\d,]+ tokens/s, [\d,]+ per device, MFU [\d.]+%",)),
    (r"shardwise plan ", (r"best layout written to (?P<file>\S+): ",)),
    (r"shardwise calibrate", (r"saved (?P<file>\S+): use --hardware local",)),
    (r"shardwise prepare .*--show-window", (r"(?m)^kjv:\d+: \d+ tokens from \d+ document\(s\)",)),
    (r"shardwise prepare ", (r"(?m)^\S+: \d+ shard\(s\), [\d,]+ documents and [\d,]+ tokens to train on",)),
    (r"shardwise convert --to-hf ", (r"exported \S+ -> (?P<file>\S+) \(\d+ safetensors file",)),
    (r"shardwise convert --from-hf ", (r"imported \S+ -> (?P<file>\S+) \(model \w+\)",)),
    (r"shardwise compare ", (r"bitwise equal: \d+ steps",)),
    (r"shardwise report ", (r"report: (?P<file>\S+report\.html)",)),
    (r"shardwise generate ", (r"\w",)),
    (r"shardwise eval ", (r"all: loss [\d.]+, perplexity [\d.]+",)),
    (r"python bench/gpu_model\.py --fit-attention", (r'"attention": 0\.\d+, "attention_seq_half": \d+',)),
    (r"python bench/gpu_model\.py --step-kernels", (r"\| step \| [\d.]+ \| [\d.]+ \| [\d.]+ \|",)),
    (r"python bench/plan_ranking\.py --report", (r"median of the repeats: step-time error",)),
    (r"python bench/published\.py", (r"\| 405B FSDP8 TP8 PP8 1F1B",)),
]
"""What each documented command must print (beyond exit 0): its result line, not merely no error."""


def expected(command: str) -> tuple[str, ...]:
    """The patterns ``command``'s output must match: its Check's own, else its kind's in :data:`SHOWS`."""
    if HOW[command].shows:
        return HOW[command].shows
    return next((shows for start, shows in SHOWS if re.match(start, command)), ())


def _add_parallelism_matrices() -> None:
    """docs/parallelism.md's verify matrices (long lines, so listed from its text)."""
    for command, doc in documented_commands().items():
        if doc == "parallelism.md" and command.startswith("shardwise verify") and command not in HOW:
            HOW[command] = _TINY_VERIFY


_add_parallelism_matrices()


def test_every_documented_command_is_checked():
    documented = documented_commands()
    missing = sorted(set(documented) - set(HOW))
    stale = sorted(set(HOW) - set(documented))
    assert not missing, f"documented commands without a check in HOW: {missing}"
    assert not stale, f"checks for commands no document shows any more: {stale}"


def test_each_covering_test_exists():
    """A command left to ``make test-all`` names a test that ``make test`` runs (not ``slow``)."""
    for command, how in HOW.items():
        if how.covered:
            path, name = how.covered.split("::")
            text = (ROOT / path).read_text()
            at = text.find(f"\ndef {name}(")
            assert at > 0, f"{command}: no test {how.covered}"
            assert "@pytest.mark.slow" not in text[text.rfind("\n\n", 0, at):at], how.covered


def test_every_command_run_checks_what_it_prints():
    assert [c for c, how in HOW.items() if how.runs and not expected(c)] == []


def _params(slow: bool) -> list:
    return [pytest.param(c, id=c[:80], marks=[pytest.mark.slow] if slow else [])
            for c, how in HOW.items() if how.runs and how.long == slow]


def _run(command: str, cwd: Path, data_cache: str) -> subprocess.CompletedProcess:
    if command.startswith(("shardwise train", "shardwise verify", "shardwise calibrate", "shardwise prepare",
                           "torchrun")):
        command += f" --data.cache_dir {data_cache}"
    if command.startswith("shardwise ") and not re.search(r"[|&;<>$`()*?~\\]", command):
        # A plain command line needs no shell: forked from the tests' CLI server, as run_cli does.
        proc = run_cli(shlex.split(command)[1:], cwd=cwd, check=False, timeout=1200)
    else:
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                              timeout=1200)
    assert proc.returncode == 0, (f"exit {proc.returncode}: {command}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc


def _scratch(tmp_path: Path) -> Path:
    for name in ("configs", "examples", "bench"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.mark.parametrize("command", _params(slow=False) + _params(slow=True))
def test_documented_command_runs(command: str, tmp_path: Path, data_cache: str):
    how = HOW[command]
    if how.needs:
        need(how.needs, shutil.which(how.needs) is not None)
    cwd = _scratch(tmp_path)
    for step in how.setup:
        _run(step, cwd, data_cache)
    proc = _run(f"{command} {how.extra}".strip(), cwd, data_cache)
    said = proc.stdout + proc.stderr
    for pattern in expected(command):
        found = re.search(pattern, said)
        assert found, f"{command}: output lacks /{pattern}/:\n{said[-3000:]}"
        if "file" in found.groupdict():
            assert (cwd / found["file"]).exists(), f"{command}: says it wrote {found['file']}, absent"
