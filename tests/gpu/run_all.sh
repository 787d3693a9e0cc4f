#!/usr/bin/env bash
# Everything that needs a GPU, in one command: tests/gpu, benchmarks/gpu/offload_largest.py and
# benchmarks/gpu/inference.py.
#
#     bash tests/gpu/run_all.sh          # from anywhere; under 9 minutes on one H200 (hard caps below)
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
# tests/harness and examples/zoo are not in the wheel: importable as `harness` and `zoo` from these folders
export PYTHONPATH=$PWD:$PWD/tests:$PWD/examples${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L || true
"$PY" -c "import torch, zerospeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
  || exit 1

# tests/gpu and the training benchmark run side by side (one GPU, 16 host cores: the tests are small;
# the benchmark's step times carry that caveat), then the inference benchmark alone (its per-token
# times are the measurement). Each has a hard cap; a hung rank dumps its stack before its timeout.
NVME=/tmp/zerospeed_nvme
timeout 270 "$PY" -m pytest -v -rs --durations=0 -p no:cacheprovider tests/gpu > "$LOGS/tests_gpu.log" 2>&1 &
tests_pid=$!
timeout 300 "$PY" benchmarks/gpu/offload_largest.py --nvme-path "$NVME" --steps 2 --budget-s 150 --cap nvme=0.4 --fsdp2 \
  --out "$LOGS/offload_largest.md" > "$LOGS/offload_largest.log" 2>&1
bench=$?
rm -rf "$NVME"
wait $tests_pid
tests=$?
timeout 200 "$PY" benchmarks/gpu/inference.py --repeats 2 --zero-new 16 > "$LOGS/inference.log" 2>&1
infer=$?
tail -n 40 "$LOGS/tests_gpu.log"; tail -n 14 "$LOGS/offload_largest.log"; tail -n 30 "$LOGS/inference.log"
echo "tests/gpu: exit $tests (124 = hit the 270 s cap); offload_largest.py: exit $bench; inference.py: exit $infer (124 = cap); logs in $LOGS"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$infer" -eq 0 ]
