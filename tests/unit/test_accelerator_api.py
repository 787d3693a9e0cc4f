"""zerospeed.accelerator speaks DeepSpeed's accelerator API: DeepSpeed's method names and parameters
(the table below is DeepSpeed 0.19.5's accelerator/abstract_accelerator.py, cpu_accelerator.py and
cuda_accelerator.py), and on this CPU machine DeepSpeed's CPU accelerator's values.

The CUDA accelerator's values are compared with torch.cuda in tests/gpu/test_gpu_accelerator.py.
"""

import contextlib
import inspect
import os

import psutil
import pytest
import torch

import zerospeed.accelerator as za
from zerospeed.accelerator import CpuAccelerator, CudaAccelerator

MIB = 2**20
_ = inspect.Parameter.empty  # no default

# method -> DeepSpeed's parameters after self, as (name, default)
DEEPSPEED_METHODS = {
    "is_synchronized_device": [],
    "use_host_timers": [],
    "resolves_data_dependency": [],
    "handles_memory_backpressure": [],
    # devices
    "device_name": [("device_index", None)],
    "device": [("device_index", None)],
    "set_device": [("device_index", _)],
    "current_device": [],
    "current_device_name": [],
    "device_count": [],
    "synchronize": [("device_index", None)],
    "is_available": [],
    # random numbers
    "random": [],
    "set_rng_state": [("new_state", _), ("device_index", None)],
    "get_rng_state": [("device_index", None)],
    "manual_seed": [("seed", _)],
    "manual_seed_all": [("seed", _)],
    "initial_seed": [],
    "default_generator": [("device_index", _)],
    # streams and graphs
    "stream": [("stream", _)],
    "current_stream": [("device_index", None)],
    "default_stream": [("device_index", None)],
    "create_graph": [],
    "capture_to_graph": [("graph", _), ("pool", None), ("stream", None)],
    "replay_graph": [("graph", _)],
    # memory
    "empty_cache": [],
    **{
        m: [("device_index", None)]
        for m in (
            "memory_allocated",
            "max_memory_allocated",
            "reset_max_memory_allocated",
            "memory_cached",
            "max_memory_cached",
            "reset_max_memory_cached",
            "memory_stats",
            "reset_peak_memory_stats",
            "memory_reserved",
            "max_memory_reserved",
            "total_memory",
            "available_memory",
        )
    },
    # dtypes
    "is_bf16_supported": [],
    "is_fp16_supported": [],
    "supported_dtypes": [],
    # tensors
    "pin_memory": [("tensor", _), ("align_bytes", 1)],
    "is_pinned": [("tensor", _)],
    "on_accelerator": [("tensor", _)],
    # misc
    "range_push": [("msg", _), ("domain", None), ("category", None)],
    "range_pop": [("domain", None)],
    "lazy_call": [("callback", _)],
    "communication_backend_name": [],
    "is_triton_supported": [],
    "prefer_triton_grouped_mm": [],
    "amp": [],  # amp: DeepSpeed before 0.18.7
    "op_builder_dir": [],
    "create_op_builder": [("class_name", _)],
    "get_op_builder": [("class_name", _)],
    "build_extension": [],
    "export_envs": [],
    "visible_devices_envs": [],
    "set_visible_devices_envs": [("current_env", _), ("local_accelerator_ids", _)],
    "get_compile_backend": [],
    "set_compile_backend": [("backend", _)],
}
DEEPSPEED_PROPERTIES = [
    "Stream",
    "Event",
    "BFloat16Tensor",
    "ByteTensor",
    "DoubleTensor",
    "FloatTensor",
    "HalfTensor",
    "IntTensor",
    "LongTensor",
]
TENSOR_TYPES = {
    "BFloat16Tensor": torch.BFloat16Tensor,
    "ByteTensor": torch.ByteTensor,
    "DoubleTensor": torch.DoubleTensor,
    "FloatTensor": torch.FloatTensor,
    "HalfTensor": torch.HalfTensor,
    "IntTensor": torch.IntTensor,
    "LongTensor": torch.LongTensor,
}


@pytest.fixture
def cpu():
    return CpuAccelerator()


@pytest.fixture
def restore_accelerator():
    saved = za._ACCELERATOR
    yield
    za._ACCELERATOR = saved


# -- the interface -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [CpuAccelerator, CudaAccelerator])
@pytest.mark.parametrize("method", sorted(DEEPSPEED_METHODS))
def test_methods_take_deepspeeds_parameters(cls, method):
    params = list(inspect.signature(getattr(cls, method)).parameters.values())
    assert params[0].name == "self"
    assert [(p.name, p.default) for p in params[1:]] == DEEPSPEED_METHODS[method], (cls.__name__, method)


@pytest.mark.parametrize("cls", [CpuAccelerator, CudaAccelerator])
def test_properties_and_attributes(cls):
    for name in DEEPSPEED_PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, name), property), name
    acc = cls()
    assert isinstance(acc, za.DeepSpeedAccelerator)
    assert acc._name == acc.name == cls._name
    assert acc._communication_backend_name == acc.communication_backend_name()
    assert acc.supports_nvtx_domain is False


def test_cuda_answers_that_need_no_gpu():
    acc = CudaAccelerator()
    assert (acc.device_name(), acc.device_name(1)) == ("cuda", "cuda:1")
    assert acc.device(1) == torch.device("cuda", 1) and acc.device() == torch.device("cuda")
    assert acc.communication_backend_name() == "nccl"
    assert not acc.is_synchronized_device() and not acc.use_host_timers()
    assert not acc.resolves_data_dependency() and not acc.handles_memory_backpressure()
    assert acc.export_envs() == ["NCCL"]
    assert acc.on_accelerator(torch.empty(1, device="meta")) is False
    assert acc.on_accelerator(torch.empty(1)) is False


# -- the CPU accelerator's values --------------------------------------------------------------------


def test_cpu_devices(cpu, monkeypatch):
    assert cpu.device_name() == cpu.device_name(0) == cpu.current_device_name() == "cpu"
    assert cpu.device() is None and cpu.device(0) is None
    assert cpu.torch_device(3) == torch.device("cpu")
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_available() and cpu.is_synchronized_device()
    assert cpu.use_host_timers() and cpu.resolves_data_dependency() and cpu.handles_memory_backpressure()
    assert cpu.set_device(0) is None and cpu.synchronize() is None and cpu.synchronize(0) is None
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cpu.current_device() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert cpu.current_device() == 3
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() >= 1  # the NUMA nodes with cores


def test_cpu_random_numbers_are_the_host_generators(cpu):
    cpu.manual_seed(1234)
    got = torch.rand(5)
    torch.manual_seed(1234)
    assert torch.equal(got, torch.rand(5))
    cpu.manual_seed_all(99)
    got = torch.rand(5)
    torch.manual_seed(99)
    assert torch.equal(got, torch.rand(5))
    assert cpu.initial_seed() == torch.initial_seed() == 99
    assert torch.equal(cpu.get_rng_state(), torch.get_rng_state())
    assert torch.equal(cpu.get_rng_state(0), torch.get_rng_state())
    state = cpu.get_rng_state()
    first = torch.rand(5)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    cpu.set_rng_state(state, 0)  # a device index names the only generator there is
    assert torch.equal(torch.rand(5), first)
    assert cpu.default_generator(0) is torch.default_generator
    assert cpu.random() is torch.random


def test_cpu_has_no_streams_events_or_graphs(cpu):
    assert cpu.Stream is None and cpu.Event is None
    assert cpu.current_stream() is None and cpu.default_stream() is None and cpu.default_stream(0) is None
    with cpu.stream(None), cpu.capture_to_graph(cpu.create_graph()):
        pass
    assert isinstance(cpu.stream(None), contextlib.AbstractContextManager)
    assert cpu.create_graph() is None and cpu.replay_graph(None) is None


def test_cpu_memory_is_the_resident_set(cpu):
    queries = [
        "memory_allocated",
        "max_memory_allocated",
        "memory_cached",
        "max_memory_cached",
        "memory_reserved",
        "max_memory_reserved",
        "total_memory",
        "available_memory",
    ]
    for q in queries:
        value = getattr(cpu, q)()
        assert isinstance(value, int) and value > 0, q
        assert getattr(cpu, q)(0) > 0, q
    rss = psutil.Process().memory_info().rss
    assert abs(cpu.memory_allocated() - rss) < 64 * MIB
    assert cpu.max_memory_allocated() >= cpu.memory_allocated()
    assert cpu.total_memory() == psutil.virtual_memory().total
    assert 0 < cpu.available_memory() <= cpu.total_memory()
    stats = cpu.memory_stats()
    assert set(stats) == {"allocated_bytes.all.current", "allocated_bytes.all.peak"}
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    for reset in ("empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached"):
        assert getattr(cpu, reset)() is None, reset


def test_cpu_peak_sees_a_freed_block_and_resets(cpu):
    block = torch.ones(128 * MIB // 4)  # touched, so resident
    during = cpu.memory_allocated()
    del block
    peak = cpu.max_memory_allocated()
    cpu.reset_peak_memory_stats()
    after_reset = cpu.max_memory_allocated()
    assert peak >= during  # never below what a query saw
    assert after_reset < peak - 64 * MIB  # the block's memory went back to the kernel, the peak with it
    assert after_reset >= cpu.memory_allocated() - 16 * MIB


def test_cpu_peak_counts_pages_no_query_saw(cpu):
    cpu.reset_peak_memory_stats()
    if not cpu._kernel_peak_counts:
        pytest.skip("the kernel's peak resident set cannot be reset here (no /proc/self/clear_refs)")
    base = cpu.memory_allocated()
    block = torch.ones(128 * MIB // 4)
    del block  # no query while the block was resident
    assert cpu.max_memory_allocated() >= base + 100 * MIB


def test_cpu_peak_without_a_kernel_reset_samples_like_deepspeed(cpu, monkeypatch):
    monkeypatch.setattr(za, "reset_kernel_peak_rss", lambda: False)
    cpu.reset_peak_memory_stats()
    base = cpu.max_memory_allocated()
    block = torch.ones(64 * MIB // 4)
    during = cpu.memory_allocated()  # a sample at the block's height
    del block
    assert cpu.max_memory_allocated() == during >= base + 48 * MIB
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_allocated() < during - 32 * MIB


def test_cpu_dtypes(cpu):
    assert cpu.is_bf16_supported() is True
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert cpu.is_fp16_supported() is fp16
    assert set(cpu.supported_dtypes()) == {torch.float32, torch.bfloat16} | ({torch.float16} if fp16 else set())


def test_cpu_tensors(cpu):
    t = torch.arange(4.0)
    assert cpu.pin_memory(t) is t and cpu.pin_memory(t, align_bytes=64) is t
    assert cpu.is_pinned(t) is False
    assert cpu.on_accelerator(t) is True and cpu.on_accelerator(torch.empty(1, device="meta")) is False
    for name, legacy in TENSOR_TYPES.items():
        assert getattr(cpu, name) is legacy, name
    assert cpu.FloatTensor([1.0, 2.0]).dtype == torch.float32
    assert cpu.pinned_empty((2, 3), torch.float16).shape == (2, 3)


def test_cpu_misc(cpu):
    assert cpu.range_push("step") is None and cpu.range_push("x", domain="d", category=1) is None
    assert cpu.range_pop() is None
    calls = []
    assert cpu.lazy_call(lambda: calls.append(1) or "done") == "done" and calls == [1]  # now, not later
    assert cpu.amp() is torch.cpu.amp
    assert cpu.is_triton_supported() is False and cpu.prefer_triton_grouped_mm() is False
    assert cpu.export_envs() == [] and cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}


def test_compile_backend(cpu):
    assert cpu.get_compile_backend() == "inductor"
    cpu.set_compile_backend("eager")
    assert cpu.get_compile_backend() == "eager"
    with pytest.raises(ValueError, match="no-such-backend"):
        cpu.set_compile_backend("no-such-backend")
    assert CpuAccelerator().get_compile_backend() == "inductor"  # per instance


def test_no_compiled_ops(cpu):
    assert cpu.get_op_builder("CPUAdamBuilder") is None and cpu.create_op_builder("AsyncIOBuilder") is None
    with pytest.raises(NotImplementedError, match="compiles no ops"):
        cpu.op_builder_dir()


# -- choosing and replacing the accelerator ----------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "cuda", "want"),
    [
        ({}, False, "cpu"),
        ({}, True, "cuda"),
        ({"DS_ACCELERATOR": "cpu"}, True, "cpu"),
        ({"DS_ACCELERATOR": "cuda"}, True, "cuda"),
        ({"ZEROSPEED_ACCELERATOR": "cpu"}, True, "cpu"),
        ({"ZEROSPEED_ACCELERATOR": "CPU"}, True, "cpu"),
        ({"ZEROSPEED_ACCELERATOR": "cpu", "DS_ACCELERATOR": "cuda"}, True, "cpu"),  # ours first
        ({"ZEROSPEED_ACCELERATOR": "", "DS_ACCELERATOR": "cpu"}, True, "cpu"),
    ],
)
def test_accelerator_choice(env, cuda, want):
    assert za.accelerator_name(env, cuda_available=cuda) == want


def test_accelerator_choice_errors():
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'.*not provided by zerospeed"):
        za.accelerator_name({"DS_ACCELERATOR": "xpu"}, cuda_available=True)
    with pytest.raises(ValueError, match="ZEROSPEED_ACCELERATOR='tpu': expected 'cpu' or 'cuda'"):
        za.accelerator_name({"ZEROSPEED_ACCELERATOR": "tpu"}, cuda_available=True)
    with pytest.raises(RuntimeError, match="DS_ACCELERATOR=cuda but torch sees no CUDA device"):
        za.accelerator_name({"DS_ACCELERATOR": "cuda"}, cuda_available=False)


def test_get_and_set_accelerator(restore_accelerator, monkeypatch):
    za._ACCELERATOR = None
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv("ZEROSPEED_ACCELERATOR", raising=False)
    acc = za.get_accelerator()
    assert isinstance(acc, CpuAccelerator) and za.get_accelerator() is acc  # chosen once
    assert za.is_current_accelerator_supported()
    mine = CpuAccelerator()
    za.set_accelerator(mine)
    assert za.get_accelerator() is mine
    with pytest.raises(TypeError, match="zerospeed.accelerator.DeepSpeedAccelerator"):
        za.set_accelerator(object())

    class Other(CpuAccelerator):
        def device_name(self, device_index=None):
            return "xpu"

    za.set_accelerator(Other())
    assert not za.is_current_accelerator_supported()


def test_this_machines_accelerator_is_cpu():
    if (
        os.environ.get("ZEROSPEED_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "")) == "cuda"
        or torch.cuda.is_available()
    ):
        pytest.skip("a CUDA machine")
    assert za.get_accelerator().device_name() == "cpu" and za.get_accelerator().communication_backend_name() == "gloo"


_HEAP_HOLES = """
import psutil, torch
from zerospeed.accelerator import CpuAccelerator
rss = lambda: psutil.Process().memory_info().rss
big = torch.ones(4 << 20)
del big  # one 16 MiB block freed: glibc raises its mmap threshold, later blocks come from its heap
blocks = [torch.ones(1 << 18) for _ in range(384)]  # 384 MiB of 1 MiB tensors, touched
del blocks[:-1]  # freed, but the last one keeps the heap's top: the holes stay resident
before = rss()
CpuAccelerator().release_host_memory()
print(before - rss())
"""


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status")
    or not hasattr(os, "confstr")
    or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
    reason="glibc's malloc_trim",
)
def test_cpu_release_host_memory_returns_the_heaps_free_pages():
    """Note [host allocator trims]: freed tensors that glibc keeps as holes inside its heap go
    back to the kernel (measured by the resident set, in a fresh process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HEAP_HOLES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= 300 * MIB, out.stdout  # (above its HOST_TRIM_MIN_FREE: it acts)
