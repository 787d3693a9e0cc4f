"""A tiny training script for the autotuner's tests: crashes or hangs at chosen micro batch sizes.

    zerospeed --autotuning tune --num_gpus 1 autotune_tiny.py --deepspeed cfg.json --crash-at 8 --hang-at 4

The hanging trial writes its pid to $ZS_TEST_OUT/hang_pid so the test can check it was killed.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

import zerospeed
from zoo.models import TinyMLP

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--crash-at", type=int, default=None)
parser.add_argument("--hang-at", type=int, default=None)
zerospeed.add_config_arguments(parser)
args = parser.parse_args()
config_path = args.deepspeed_config or args.deepspeed
micro = json.loads(Path(config_path).read_text())["train_micro_batch_size_per_gpu"]
if micro == args.crash_at:
    raise RuntimeError(f"simulated out of memory at micro batch {micro}")
if micro == args.hang_at:
    Path(os.environ["ZS_TEST_OUT"], "hang_pid").write_text(str(os.getpid()))
    time.sleep(600)

torch.manual_seed(0)
model = TinyMLP(d_in=16, d_hidden=32, d_out=4)
engine, *_ = zerospeed.initialize(args=args, model=model, model_parameters=model.parameters())
for _ in range(1000):
    x = torch.randn(micro, 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
