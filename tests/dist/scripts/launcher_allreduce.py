"""Launcher test helper: join a gloo group from the environment and all-reduce rank + 1."""

import datetime
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
with open(os.path.join(os.environ["ZS_TEST_OUT"], f"sum{rank}"), "w") as f:
    f.write(f"{rank} {world} {t.item()}")
dist.destroy_process_group()
