"""The test harness (tests only; not part of the zerospeed wheel): spawn+gloo ranks, a reference trainer, a census."""

from harness.census import live_tensor_bytes, live_tensor_storages
from harness.reference import reference_train, split_global_batch
from harness.spawn import DistributedTestError, free_port, per_world, run_distributed

__all__ = [
    "DistributedTestError",
    "free_port",
    "live_tensor_bytes",
    "live_tensor_storages",
    "reference_train",
    "per_world",
    "run_distributed",
    "split_global_batch",
]
