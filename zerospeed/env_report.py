"""`zerospeed-report`: what this machine offers zerospeed (DeepSpeed's `ds_report`, nothing to compile).

Sections: versions (Python, torch, zerospeed, required and optional packages), accelerator (kind,
devices, memory), communication (gloo / NCCL / MPI availability), CPU (model, cores, vector
extensions), pinned memory (does pinning work here) and async I/O (does O_DIRECT work under a path,
and which backend NVMe offload would use).
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import mmap
import os
import platform
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.comm import backend_availability

OPTIONAL = (
    "numpy",
    "pydantic",
    "psutil",
    "tqdm",
    "tensorboard",
    "wandb",
    "comet_ml",
    "transformers",
    "safetensors",
    "deepspeed",
)
ALIGN = 4096  # O_DIRECT needs buffers, offsets and sizes aligned to the device's logical block


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "zerospeed": _version("zerospeed"),
        "torch cuda": str(torch.version.cuda),
    }
    out.update({name: _version(name) for name in OPTIONAL})
    return out


def accelerator() -> dict[str, str]:
    acc = get_accelerator()
    out = {
        "accelerator": acc.name,
        "communication backend": acc.communication_backend_name(),
        "cuda available": str(torch.cuda.is_available()),
        "device count": str(acc.device_count()),
        "host memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
    }
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out[f"cuda:{i}"] = f"{p.name}, {p.total_memory / 2**30:.1f} GiB"
    return out


def communication() -> dict[str, str]:
    return backend_availability()


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def vector_extensions(flags: set[str]) -> dict[str, str]:
    """AVX2 / AVX-512 (foundation, bf16) / AMX (tile, bf16) present or not."""
    names = {
        "AVX2": "avx2",
        "AVX-512F": "avx512f",
        "AVX-512 BF16": "avx512_bf16",
        "AMX tile": "amx_tile",
        "AMX BF16": "amx_bf16",
    }
    return {label: "yes" if flag in flags else "no" for label, flag in names.items()}


def cpu() -> dict[str, str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    out = {
        "model": model,
        "cores": f"{psutil.cpu_count(logical=False)} physical, {psutil.cpu_count()} logical",
        "torch cpu capability": torch.backends.cpu.get_cpu_capability(),
    }
    out.update(vector_extensions(cpu_flags(text)))
    return out


def pinned_memory() -> dict[str, str]:
    try:
        t = torch.empty(1024).pin_memory()
        return {"pinned memory": "works" if t.is_pinned() else "pin_memory() returned an unpinned tensor"}
    except Exception as exc:  # CPU-only builds raise: pinning needs an accelerator runtime
        return {"pinned memory": f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0]})"}


def o_direct_works(path: str | Path) -> tuple[bool, str]:
    """Write and read back one aligned block with O_DIRECT in a temporary file under `path`."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this OS has no O_DIRECT"
    try:
        fd_tmp, name = tempfile.mkstemp(dir=path, prefix=".zerospeed-odirect-")
        os.close(fd_tmp)
    except OSError as exc:
        return False, f"cannot create a file under {path}: {exc.strerror}"
    try:
        buf = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT requires
        buf.write(b"z" * ALIGN)
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwritev(fd, [buf], 0)
            back = mmap.mmap(-1, ALIGN)
            os.preadv(fd, [back], 0)
            ok = back[:] == buf[:]
        finally:
            os.close(fd)
        return ok, "works" if ok else "read-back mismatch"
    except OSError as exc:
        return False, f"fails ({exc.strerror}; tmpfs and some overlay filesystems refuse O_DIRECT)"
    finally:
        os.unlink(name)


def async_io(path: str | Path) -> dict[str, str]:
    ok, detail = o_direct_works(path)
    backend = "thread pool, O_DIRECT pread/pwrite" if ok else "thread pool, buffered pread/pwrite"
    return {
        "path": str(path),
        "O_DIRECT": detail,
        "backend that NVMe offload would use": backend,
        "libaio (not needed)": "found" if ctypes.util.find_library("aio") else "not found",
    }


def collect(path: str | Path = ".") -> dict[str, dict[str, str]]:
    """Every section of the report, as {section: {item: text}}."""
    return {
        "versions": versions(),
        "accelerator": accelerator(),
        "communication": communication(),
        "cpu": cpu(),
        "pinned memory": pinned_memory(),
        "async I/O": async_io(path),
    }


def format_report(report: dict[str, dict[str, str]]) -> str:
    width = max(len(k) for items in report.values() for k in items) + 2
    lines = []
    for section, items in report.items():
        lines.append(f"-- {section} " + "-" * max(0, 60 - len(section)))
        lines += [f"{k:<{width}}{v}" for k, v in items.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerospeed-report", description=__doc__.split("\n")[0])
    p.add_argument("--path", default=".", help="directory to test O_DIRECT under (where NVMe offload would write)")
    args = p.parse_args(argv)
    print(format_report(collect(args.path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
