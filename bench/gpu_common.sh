# Sourced by the bench/gpu_*.sh scripts after they set `out` and `deadline`: the wheels of .whl/
# installed beside the machine's torch (it reaches no registry), the work folder, the machine's facts,
# and `left` (seconds to the deadline).
work=$(mktemp -d)
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__)"
lscpu | grep -m1 "Model name"
# The tree the checks ran on, for docs/status.md's GPU section: a device copy has no .git, so the caller
# names it (SHARDWISE_COMMIT=$(git rev-parse --short HEAD) in the command it sends).
echo "commit ${SHARDWISE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (set SHARDWISE_COMMIT)')}"
left() { echo $((deadline - SECONDS)); }
