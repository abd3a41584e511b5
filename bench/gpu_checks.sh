#!/usr/bin/env bash
# One call on a lent GPU machine: the CUDA paths that had not run on a GPU yet, most important first,
# within a deadline (a device call is limited to 10 minutes).
#
#   ./bench/gpu_checks.sh OUT_DIR [SECONDS]
#
# 1. `pytest -m gpu tests/gpu` (the generation test among them);
# 2. the generate journey on CUDA: train the debug preset, then `shardwise generate` greedy on the
#    GPU in bf16 and fp32 and on the CPU in fp32 (the fp32 continuations should be the same text);
# 3. `--nproc 2` with one GPU: more ranks than GPUs, refused in one line (exit 2);
# 4. float8 tensorwise beside the bf16 one-GPU default on the 1B, in one call (bench/vs_torchtitan.py).
#
# Needs torchao's wheel (and the other pure-Python ones) in .whl/ (bench/gpu_common.sh installs them).
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [SECONDS]}
deadline=$((SECONDS + ${2:-540}))
source "$(dirname "$0")/gpu_common.sh"

echo "== 1. tests/gpu ($(left) s left)"
timeout 200 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -25 | tee "$out/tests.log"

echo "== 2. generate on CUDA ($(left) s left)"
timeout 120 python3 -m shardwise train --config configs/debug.toml --run.device cuda --training.steps 60 \
    --run.dir "$work/dbg" --eval.interval 0 --metrics.log_format line 2>&1 | tail -4
for v in "cuda bf16" "cuda fp32" "cpu fp32"; do
    set -- $v
    echo "-- generate --device $1 --dtype $2"
    timeout 60 python3 -m shardwise generate --checkpoint "$work/dbg" --prompt "In the beginning" \
        --max-new-tokens 24 --temperature 0 --device "$1" --dtype "$2" --json 2>&1 | tail -2 \
        | tee "$out/generate_$1_$2.txt"
done

echo "== 3. --nproc 2 on one GPU ($(left) s left)"
timeout 90 python3 -m shardwise train --config configs/debug.toml --run.device cuda --nproc 2 \
    --training.steps 2 --run.dir "$work/two" 2>&1 | tail -8 | tee "$out/nproc2.txt"
echo "rc=${PIPESTATUS[0]}" | tee -a "$out/nproc2.txt"

echo "== 4. float8 tensorwise beside bf16, 1B 4x2048 ($(left) s left)"
[ "$(left)" -gt 60 ] && timeout "$(left)" python3 bench/vs_torchtitan.py --shapes 1b-4x2048 \
    --sides shardwise shardwise-fp8-tensorwise --repeats 1 --out "$out/fp8.json" --logs "$work/logs" 2>&1 | tail -20
echo "done, $(left) s left"
