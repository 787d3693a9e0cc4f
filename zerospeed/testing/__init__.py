"""Test support: spawn+gloo harness, tiny models, a reference trainer, a tensor-memory census."""
from zerospeed.testing.census import live_tensor_bytes, live_tensor_storages
from zerospeed.testing.reference import reference_train, split_global_batch
from zerospeed.testing.spawn import DistributedTestError, free_port, per_world, run_distributed

__all__ = ["DistributedTestError", "free_port", "live_tensor_bytes", "live_tensor_storages", "reference_train",
           "per_world", "run_distributed", "split_global_batch"]
