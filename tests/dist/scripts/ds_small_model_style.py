"""A client script in the shape of DeepSpeed's own tests/small_model_debugging/test_model.py (a linear
layer applied twice, a config written to a temp file and passed as args.deepspeed_config, `--zero N`
from the command line, per-rank seeds, a DistributedSampler loader over device tensors), runnable
UNCHANGED under real DeepSpeed and under zerospeed's shim.

Differences from the original, to make it a deterministic CPU test: hidden 64 instead of 4096, fp32
instead of fp16 (DeepSpeed's CPU path), 16 samples per step on 2 ranks, and rank 0 writing its per-step
losses to --loss_log.
"""

import argparse
import json
import os
import tempfile

import deepspeed
import deepspeed.comm as dist
import torch
from torch.utils.data.distributed import DistributedSampler


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.cross_entropy_loss(self.linear(self.linear(x)), y)


def get_data_loader(model, total_samples, hidden_dim, device):
    batch_size = model.train_micro_batch_size_per_gpu()
    train_data = torch.randn(total_samples, hidden_dim, device=device)
    train_label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    dataset = torch.utils.data.TensorDataset(train_data, train_label)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))


def get_args(tmpdir, config_dict):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--loss_log", type=str, default="")
    args = parser.parse_args()
    config_dict["zero_optimization"]["stage"] = args.zero
    path = os.path.join(tmpdir, "temp_config.json")
    with open(path, "w") as f:
        json.dump(config_dict, f)
    args.deepspeed_config = path
    return args


rank = int(os.environ["RANK"])
torch.random.manual_seed(2222 + rank)
config_dict = {
    "train_batch_size": 16,
    "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 20, "reduce_scatter": True},
}
with tempfile.TemporaryDirectory() as tmp:
    args = get_args(tmp, config_dict)
    hidden_dim = 64
    model = SimpleModel(hidden_dim)
    model, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), dist_init_required=True
    )
    losses = []
    for epoch in range(2):
        for n, batch in enumerate(get_data_loader(model, total_samples=64, hidden_dim=hidden_dim, device=model.device)):
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            losses.append(loss.item())
    if dist.get_rank() == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({"losses": losses}, f)
