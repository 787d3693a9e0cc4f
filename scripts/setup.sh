# Sourced by demo.sh and test.sh: a project virtual environment with everything installed.
# torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZEROSPEED_VENV:-$ROOT/.venv}"
TORCH_SPEC="${ZEROSPEED_TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.zerospeed-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $VENV ($TORCH_SPEC, zerospeed[test]) ..."
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch, pydantic, matplotlib, tensorboard, zerospeed" || { echo "setup failed" >&2; exit 1; }
  # `import deepspeed` and the `deepspeed` command served by zerospeed (refuses if a real DeepSpeed is here)
  "$VENV/bin/zerospeed-compat" install
  echo "$want" > "$stamp"
fi
# the test harness (tests/harness) and the examples' shared models (examples/zoo) are not part of the
# zerospeed wheel; tests, benchmarks and examples import them as `harness` and `zoo` from this environment
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n%s\n' "$ROOT/tests" "$ROOT/examples" > "$site/zerospeed-dev.pth"
export PATH="$VENV/bin:$PATH"
