#!/usr/bin/env bash
# The test command: installs what it needs, then runs the whole suite (unit, multi-process, gpu-if-present).
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# sshd, pdsh, mpirun and Slurm for the multi-node launcher tests only (never fails: those tests then skip loudly)
bash "$ROOT/scripts/install_daemons.sh" || true
# lint and format first: the tree stays ruff-clean (config in pyproject.toml)
ruff check .
ruff format --check .
python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
