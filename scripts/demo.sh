#!/usr/bin/env bash
# The demo: installs what it needs, then trains a small GPT on 2 processes through the launcher.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
zerospeed --num_gpus 2 examples/train_gpt.py --deepspeed examples/configs/gpt_zero2.json "$@"
