#!/usr/bin/env bash
# One call on a lent GPU machine: bench/vs_torchtitan.py's runs, most important first, then the CUDA
# tests of the one-GPU path, within a deadline (a device call is limited to 10 minutes).
#
#   ./bench/gpu_vs_torchtitan.sh OUT_DIR [SECONDS]
#
# Needs torchtitan 0.2.2 and its pure-Python dependencies as wheels in .whl/ (the machine reaches no
# registry; bench/results/history.md lists them). Writes OUT_DIR/{main,more,variants}.json (rewritten
# after each side), OUT_DIR/tests.log and OUT_DIR/all.tgz (every side's log and kernel profile).
set -u
out=${1:?usage: gpu_vs_torchtitan.sh OUT_DIR [SECONDS]}
deadline=$((SECONDS + ${2:-560}))
source "$(dirname "$0")/gpu_common.sh"
python3 -c "import torchtitan; print('torchtitan', torchtitan.__version__)"

bench() {  # bench NAME ARGS...: one invocation of vs_torchtitan.py, cut at the deadline
    local name=$1; shift
    [ "$(left)" -gt 40 ] || { echo "skipped $name: $(left) s left"; return; }
    echo "== $name ($(left) s left)"
    timeout "$(left)" python3 bench/vs_torchtitan.py --out "$out/$name.json" --logs "$work/logs" "$@"
}

# 1) the headline pairs: the dense 1B and the MoE, both sides, two runs in alternating order
bench main --shapes 1b-4x2048 qwen3moe-3layers-2x4096 --repeats 2 --profile-dir "$work/prof"
# 2) the one-GPU path's correctness on CUDA (the trainer's step against torch's AMP and Hugging Face)
if [ "$(left)" -gt 60 ]; then
    echo "== tests ($(left) s left)"
    timeout 100 python3 -m pytest -q -x -m gpu tests/gpu -p no:cacheprovider \
        -k "amp or trainer_step or fused_loss" 2>&1 | tail -30 | tee "$out/tests.log"
fi
# 3) the other two shapes, one run each
bench more --shapes 8b-8layers-1x8192 1b-1x8192 --repeats 1
# 4) float8 rowwise and the FSDP one-rank path beside the default, on the 1B
bench variants --shapes 1b-4x2048 --sides shardwise-fp8-rowwise shardwise-fsdp --repeats 1 \
    --profile-dir "$work/prof"
tar czf "$out/all.tgz" -C "$work" . && echo "done, $(left) s left"
