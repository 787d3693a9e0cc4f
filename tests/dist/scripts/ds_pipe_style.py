"""A client script in the shape of DeepSpeedExamples' pipeline-parallelism tutorial
(training/pipeline_parallelism/train.py: an AlexNet flattened into a layer list with `join_layers`,
`PipelineModule(layers=..., loss_fn=CrossEntropyLoss(), num_stages=..., partition_method=...)`,
`deepspeed.initialize(args=..., model=net, model_parameters=..., training_data=trainset)` and
`engine.train_batch()` in a loop), runnable UNCHANGED under real DeepSpeed and under zerospeed's shim.

Differences from the tutorial, to make it a deterministic CPU test: a small AlexNet-shaped net on
synthetic 3x16x16 images (a fixed-seed TensorDataset, 10 classes) instead of torchvision's AlexNet on
CIFAR-10, gloo instead of nccl, get_accelerator().set_device instead of torch.cuda.set_device, and
rank 0 writing the per-step losses to --loss_log.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule


class TinyAlexNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=10)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--backend", type=str, default="gloo")
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--loss_log", type=str, default="")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_trainset(n=512, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = TinyAlexNet(num_classes=10)
    net = PipelineModule(
        layers=join_layers(net),
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=part,
        activation_checkpoint_interval=0,
    )
    trainset = synthetic_trainset()
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=trainset
    )
    losses = []
    for step in range(args.steps):
        loss = engine.train_batch()
        losses.append(float(loss))
    if torch.distributed.get_rank() == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(args.local_rank)
    train_pipe(args)
