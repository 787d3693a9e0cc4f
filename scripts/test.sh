#!/usr/bin/env bash
# The test command: installs what it needs, then runs the whole suite (unit, multi-process, gpu-if-present).
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
