"""A client script in the shape of DeepSpeedExamples' CIFAR-10 tutorial
(training/cifar/cifar10_deepspeed.py), runnable UNCHANGED under real DeepSpeed and under zerospeed
through its `deepspeed` shim.

Differences from the tutorial, all to make it a deterministic test: synthetic data (a fixed-seed
TensorDataset of 3x32x32 images, 10 classes) instead of torchvision's CIFAR-10, a fixed
`torch.manual_seed` before the model is built, a `--max_steps` cut-off, and rank 0 writing its
per-step losses to `--loss_log` as JSON.
"""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--max_steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--loss_log", type=str, default="", help="rank 0 writes its per-step losses here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n=256, seed=1234):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    trainset = synthetic_cifar()

    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    criterion = nn.CrossEntropyLoss()

    losses, samples = [], []
    step = 0
    for epoch in range(100):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            samples.append(labels.tolist())
            if local_rank == 0:
                print(f"[{epoch + 1}, {i + 1:5d}] loss: {loss.item():.8f}")
            step += 1
            if step >= args.max_steps:
                break
        if step >= args.max_steps:
            break

    if torch.distributed.get_rank() == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({"losses": losses, "labels": samples}, f)
    print("Finished Training")


if __name__ == "__main__":
    main()
