#!/usr/bin/env bash
# Everything that needs a GPU, in one command: tests/gpu, then benchmarks/gpu/offload_largest.py.
#
#     bash tests/gpu/run_all.sh          # from anywhere; about 10 minutes on one H200 (hard caps below)
#
# Logs (and the benchmark's table) go to $OUT if set (the device tool's result folder), else
# /tmp/zerospeed-gpu. A folder .whl/ at the repo root holding wheels (pydantic & co., see
# tests/gpu/README.md) is installed first, for machines whose Python lacks them.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/zerospeed-gpu}
mkdir -p "$LOGS"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L || true
"$PY" -c "import torch, zerospeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
  || exit 1

# tests: ~4 minutes on one GPU (each test spawns its ranks; a hung rank dumps its stack before its timeout)
timeout 360 "$PY" -m pytest -v -rs --durations=0 -p no:cacheprovider tests/gpu 2>&1 | tee "$LOGS/tests_gpu.log"
tests=${PIPESTATUS[0]}

# benchmark: stops starting new model sizes after --budget-s; the timeout caps a size still running
NVME=/tmp/zerospeed_nvme
timeout 240 "$PY" benchmarks/gpu/offload_largest.py --nvme-path "$NVME" --steps 2 --budget-s 150 \
  --out "$LOGS/offload_largest.md" 2>&1 | tee "$LOGS/offload_largest.log"
bench=${PIPESTATUS[0]}
rm -rf "$NVME"

echo "tests/gpu: exit $tests (124 = hit the 360 s cap); offload_largest.py: exit $bench (124 = hit the 240 s cap); logs in $LOGS"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
