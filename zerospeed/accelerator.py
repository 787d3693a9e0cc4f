"""Everything device-specific, in one place: cpu (gloo) or cuda (nccl).

The rest of zerospeed asks `get_accelerator()` for devices, the communication backend, memory
statistics and pinning, and never calls `torch.cuda` itself. Set ZEROSPEED_ACCELERATOR=cpu to force
the CPU path on a machine with GPUs.
"""
from __future__ import annotations

import functools
import os
import resource
import sys

import psutil
import torch


class CpuAccelerator:
    """Host execution; processes talk over gloo. Memory numbers are the process's resident set."""

    name = "cpu"
    communication_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return psutil.Process().memory_info().rss

    def max_memory_allocated(self) -> int:
        # ru_maxrss is KiB on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024

    def reset_peak_memory_stats(self) -> None:
        pass  # the kernel's peak RSS cannot be reset; callers compare before/after instead

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t  # pinning only helps host<->device copies, and there is no device here

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    # random numbers: the host generator is the only one
    def current_device(self) -> torch.device | None:
        return None

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CudaAccelerator:
    """NVIDIA GPUs; processes talk over NCCL."""

    name = "cuda"
    communication_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(self.device(local_rank))

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    # random numbers: each GPU has its own generator
    def current_device(self) -> torch.device | None:
        return torch.device("cuda", torch.cuda.current_device())

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype is torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return dtype in (torch.float32, torch.float16, torch.float64)


Accelerator = CpuAccelerator | CudaAccelerator


@functools.cache
def get_accelerator() -> Accelerator:
    """The accelerator of this process: cuda when a GPU is visible, else cpu (env can force cpu)."""
    forced = os.environ.get("ZEROSPEED_ACCELERATOR", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROSPEED_ACCELERATOR={forced!r}: expected 'cpu' or 'cuda'")
    if forced == "cpu" or (forced == "" and not torch.cuda.is_available()):
        return CpuAccelerator()
    if not torch.cuda.is_available():
        raise RuntimeError("ZEROSPEED_ACCELERATOR=cuda but torch sees no CUDA device")
    return CudaAccelerator()
