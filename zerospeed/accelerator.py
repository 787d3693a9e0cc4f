"""Everything device-specific, in one place: cpu (gloo) or cuda (nccl), behind DeepSpeed's interface.

The rest of zerospeed asks `get_accelerator()` for devices, the communication backend, memory
statistics and pinning, and never calls `torch.cuda` itself. The accelerators answer DeepSpeed's
accelerator API (`deepspeed.accelerator.get_accelerator()`, DeepSpeed 0.19): the same method names,
parameters and return values, so scripts and libraries written against DeepSpeed's accelerator run
unchanged. DeepSpeed's API names devices by index (`device(i)` is its torch device, None on the CPU;
`current_device()` is an int); zerospeed's own code places tensors with `torch_device(local_rank)`,
which is a `torch.device` on every accelerator.

Which accelerator: ZEROSPEED_ACCELERATOR, else DeepSpeed's DS_ACCELERATOR ("cpu" or "cuda"; the
first wins when both are set), else cuda when torch sees a GPU, else cpu. `set_accelerator` replaces
the choice for the whole process.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import os
import random
import resource
import sys
from collections.abc import Callable, Mapping

import numpy as np
import psutil
import torch

# DeepSpeed's names of the accelerators it can run on; zerospeed provides the first two.
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]
_DEEPSPEED_ONLY = ["xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa"]


class DeepSpeedAccelerator:
    """DeepSpeed's accelerator interface: what does not depend on the device, written once.

    The subclasses provide the device's own methods (devices, RNG, streams, memory, dtypes, tensor
    constructors). zerospeed compiles no ops, so the op-builder queries answer that none exists.
    """

    _name: str
    _communication_backend_name: str
    _compile_backend = "inductor"
    supports_nvtx_domain = False  # range_push/range_pop accept a domain and ignore it

    @property
    def name(self) -> str:
        """zerospeed's spelling of DeepSpeed's ``_name``: "cpu" or "cuda"."""
        return self._name

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def release_host_memory(self) -> None:
        """Hand freed host memory back (Note [host allocator trims]); nothing where the step's memory is
        a device's own (CUDA: its caching allocator)."""

    # -- what a synchronous (host) device implies ---------------------------------------------------
    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # -- memory: DeepSpeed's older names, as torch defines them ---------------------------------------
    def memory_cached(self, device_index=None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_max_memory_cached(self, device_index=None) -> None:
        self.reset_peak_memory_stats(device_index)

    # -- dtypes ---------------------------------------------------------------------------------------
    def supported_dtypes(self) -> list[torch.dtype]:
        optional = [(torch.float16, self.is_fp16_supported()), (torch.bfloat16, self.is_bf16_supported())]
        return [torch.float32] + [dtype for dtype, supported in optional if supported]

    # -- tensors --------------------------------------------------------------------------------------
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # DeepSpeed's tensor constructors: torch's legacy CPU types, or torch.tensor on the device
    @property
    def BFloat16Tensor(self):
        return self._tensor_type(torch.bfloat16)

    @property
    def ByteTensor(self):
        return self._tensor_type(torch.uint8)

    @property
    def DoubleTensor(self):
        return self._tensor_type(torch.float64)

    @property
    def FloatTensor(self):
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self):
        return self._tensor_type(torch.float16)

    @property
    def IntTensor(self):
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self):
        return self._tensor_type(torch.int64)

    # -- kernels: zerospeed builds none ---------------------------------------------------------------
    def prefer_triton_grouped_mm(self) -> bool:
        return False

    def op_builder_dir(self) -> str:
        raise NotImplementedError(
            "zerospeed compiles no ops, so it has no op_builder package; its optimizers, "
            "offload and async I/O are pure PyTorch (zerospeed.optim, zerospeed.offload)"
        )

    def get_op_builder(self, class_name: str) -> None:
        """None: DeepSpeed's answer for an op builder that does not exist here (none does)."""

    def create_op_builder(self, class_name: str) -> None:
        """None, as `get_op_builder`."""

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    # -- launcher and compiler ------------------------------------------------------------------------
    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"compile backend {backend!r} is not known to torch on {self._name}; known backends: {known}"
            )
        self._compile_backend = backend


# Note [host peak memory]: on the CPU, "allocated" is the process's resident set, as in DeepSpeed,
# whose peak is the largest resident set its queries sampled since the last reset. zerospeed's
# peak is also at least the kernel's high-water mark (VmHWM), which saw every page ever resident,
# not only the moments someone asked; Linux resets it by writing "5" to /proc/self/clear_refs.
# Where that reset fails (macOS, a locked-down /proc), the peak after a reset is the sampled one.

# Note [host allocator trims]: on the CPU a step's tensors come from glibc's malloc, which serves
# everything under its mmap threshold (raised up to 32 MiB after the first large free) from heaps it
# returns to the kernel only at their top. Memory freed in an order unlike the allocations' stays
# resident as holes that later, differently sized tensors fit badly. `release_host_memory` hands that
# free memory back (`malloc_trim`, which also releases whole free pages inside the heaps) — but only
# when the heaps hold at least HOST_TRIM_MIN_FREE free bytes, because whatever is handed back is
# faulted in again when reused. Measured on GPT-2 88M (2 ranks, fp32): trimming before every forward,
# backward and optimizer step lowered stage 0's resident peak from 3,790 to 3,445 MiB but made its
# step 26% slower (a small model: 30-45%), so the engine does not do that; stage 3, whose gathers and
# releases churn unit-sized blocks, trims as it releases (Note [host allocator between releases],
# zero/stage3/strategy.py). A CUDA device's memory is its caching allocator's: there it does nothing.
HOST_TRIM_MIN_FREE = 256 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _kernel_peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def reset_kernel_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _numa_nodes_with_cores() -> int:
    """How many NUMA nodes have CPU cores (DeepSpeed counts one CPU accelerator per node); 0 if unknown."""
    lists = set()
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        with open(path) as f:
            cores = f.read().strip()
        if cores:
            lists.add(cores)
    return len(lists)


class CpuAccelerator(DeepSpeedAccelerator):
    """Host execution; processes talk over gloo. Memory numbers are the process's resident set."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        # Note [host peak memory]
        self._sampled_peak = _rss()
        self._kernel_peak_counts = True

    # -- zerospeed's placement ------------------------------------------------------------------------
    def torch_device(self, local_rank: int = 0) -> torch.device:
        """Where zerospeed puts this rank's tensors."""
        return torch.device("cpu")

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    # -- devices --------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def device(self, device_index=None) -> None:
        return None

    def set_device(self, device_index) -> None:
        pass

    def current_device(self) -> int:
        """LOCAL_RANK, as in DeepSpeed (whose CPU accelerator returns the variable's text when it is set)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """LOCAL_SIZE when a launcher set it, else the NUMA nodes with cores (DeepSpeed's count)."""
        local_size = int(os.environ.get("LOCAL_SIZE", "0"))
        return local_size if local_size > 0 else max(1, _numa_nodes_with_cores())

    def synchronize(self, device_index=None) -> None:
        pass

    # -- random numbers: the host generator is the only one --------------------------------------------
    def random(self):
        return torch.random

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index) -> torch.Generator:
        return torch.default_generator

    # -- streams, events, graphs: the host runs in order, so there are none ------------------------------
    @property
    def Stream(self) -> None:
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None) -> None:
        return None

    def default_stream(self, device_index=None) -> None:
        return None

    @property
    def Event(self) -> None:
        return None

    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        pass

    # -- memory (Note [host peak memory]) ---------------------------------------------------------------
    def empty_cache(self) -> None:
        _malloc_trim()

    def release_host_memory(self) -> None:
        """Note [host allocator trims]."""
        _malloc_trim(min_free=HOST_TRIM_MIN_FREE)

    def memory_allocated(self, device_index=None) -> int:
        rss = _rss()
        self._sampled_peak = max(self._sampled_peak, rss)
        return rss

    def max_memory_allocated(self, device_index=None) -> int:
        self.memory_allocated()
        return max(self._sampled_peak, _kernel_peak_rss()) if self._kernel_peak_counts else self._sampled_peak

    def reset_peak_memory_stats(self, device_index=None) -> None:
        self._kernel_peak_counts = reset_kernel_peak_rss()
        self._sampled_peak = _rss()

    def memory_reserved(self, device_index=None) -> int:
        return self.memory_allocated()

    def max_memory_reserved(self, device_index=None) -> int:
        return self.max_memory_allocated()

    def memory_stats(self, device_index=None) -> dict[str, int]:
        current = self.memory_allocated()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index=None) -> int:
        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        return psutil.virtual_memory().available

    # -- dtypes ---------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels on this CPU (DeepSpeed's test)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):  # an older torch, or a build without oneDNN
            return False

    # -- pinning: only host<->device copies gain from it, and there is no device --------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def _tensor_type(self, dtype: torch.dtype):
        return _CPU_TENSOR_TYPES[dtype]

    # -- misc -----------------------------------------------------------------------------------------
    def range_push(self, msg: str, domain=None, category=None) -> None:
        pass

    def range_pop(self, domain=None) -> None:
        pass

    def lazy_call(self, callback: Callable):
        return callback()

    def amp(self):
        """DeepSpeed < 0.18.7's per-device AMP module (newer code uses torch.amp)."""
        return torch.cpu.amp

    def is_triton_supported(self) -> bool:
        return False

    def export_envs(self) -> list[str]:
        return []


_CPU_TENSOR_TYPES = {
    torch.bfloat16: torch.BFloat16Tensor,
    torch.uint8: torch.ByteTensor,
    torch.float64: torch.DoubleTensor,
    torch.float32: torch.FloatTensor,
    torch.float16: torch.HalfTensor,
    torch.int32: torch.IntTensor,
    torch.int64: torch.LongTensor,
}


class CudaAccelerator(DeepSpeedAccelerator):
    """NVIDIA GPUs; processes talk over NCCL."""

    _name = "cuda"
    _communication_backend_name = "nccl" if sys.platform != "win32" else "gloo"

    # -- zerospeed's placement ------------------------------------------------------------------------
    def torch_device(self, local_rank: int = 0) -> torch.device:
        """This rank's GPU: local rank r computes on GPU r (modulo the GPUs visible)."""
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    # -- devices --------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_synchronized_device(self) -> bool:
        return False

    def device_name(self, device_index=None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index) -> None:
        """DeepSpeed's torch.cuda.set_device; an index past the visible GPUs wraps, as in `torch_device`."""
        torch.cuda.set_device(self.torch_device(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    def communication_backend_version(self):
        return torch.cuda.nccl.version()

    # -- random numbers: each GPU has its own generator (device_index None: the current GPU's) ------------
    def random(self):
        return torch.random

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # -- streams, events, graphs ------------------------------------------------------------------------
    @property
    def Stream(self):
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):
        return torch.cuda.Event

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    # -- memory ---------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None) -> int:
        """Free bytes on the GPU as the driver reports them (what NVML reports, other processes included)."""
        return torch.cuda.mem_get_info(device_index)[0]

    # -- dtypes ---------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True

    def is_fp16_supported(self) -> bool:
        """Compute capability 7+ (6.x too with DS_ALLOW_DEPRECATED_FP16=1, as in DeepSpeed)."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    # -- tensors --------------------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def _tensor_type(self, dtype: torch.dtype):
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")

    # -- misc -----------------------------------------------------------------------------------------
    def range_push(self, msg: str, domain=None, category=None):
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable):
        return torch.cuda._lazy_call(callback)

    def amp(self):
        """DeepSpeed < 0.18.7's per-device AMP module (newer code uses torch.amp)."""
        return torch.cuda.amp

    def is_triton_supported(self) -> bool:
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def export_envs(self) -> list[str]:
        return ["NCCL"]


# -- choosing the accelerator ------------------------------------------------------------------------


def accelerator_name(environ: Mapping[str, str], cuda_available: bool) -> str:
    """ "cpu" or "cuda": ZEROSPEED_ACCELERATOR, else DS_ACCELERATOR, else cuda when torch sees a GPU."""
    for var in ("ZEROSPEED_ACCELERATOR", "DS_ACCELERATOR"):
        forced = environ.get(var, "").lower()
        if not forced:
            continue
        if forced in _DEEPSPEED_ONLY:
            raise ValueError(
                f"{var}={forced!r}: DeepSpeed's {forced} accelerator is not provided by zerospeed, "
                f"which runs on {' and '.join(SUPPORTED_ACCELERATOR_LIST)}"
            )
        if forced not in SUPPORTED_ACCELERATOR_LIST:
            raise ValueError(f"{var}={forced!r}: expected 'cpu' or 'cuda'")
        if forced == "cuda" and not cuda_available:
            raise RuntimeError(f"{var}=cuda but torch sees no CUDA device")
        return forced
    return "cuda" if cuda_available else "cpu"


_ACCELERATOR: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator of this process, chosen once (see the module docstring)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = accelerator_name(os.environ, torch.cuda.is_available())
        _ACCELERATOR = CudaAccelerator() if name == "cuda" else CpuAccelerator()
    return _ACCELERATOR


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Use `accel_obj` as this process's accelerator from now on (DeepSpeed's override)."""
    global _ACCELERATOR
    if not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(
            f"set_accelerator needs a zerospeed.accelerator.DeepSpeedAccelerator, got {type(accel_obj).__name__}"
        )
    _ACCELERATOR = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (2.33+)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
        else:
            if hasattr(_LIBC, "mallinfo2"):
                _LIBC.mallinfo2.restype = _MallInfo2
    return _LIBC


def _malloc_trim(min_free: int = 0) -> None:
    """Hand the host allocator's free memory back to the kernel (glibc's malloc_trim; elsewhere nothing),
    if its heaps hold at least `min_free` free bytes (known from mallinfo2 where glibc has it)."""
    libc = _libc()
    if not libc:
        return
    if min_free and hasattr(libc, "mallinfo2") and libc.mallinfo2().fordblks < min_free:
        return
    libc.malloc_trim(0)


_LIBC = None


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's), as DeepSpeed does."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
