"""Offload I/O: asynchronous, O_DIRECT-capable file I/O in pure Python, swap files and host buffer pools."""

from zerospeed.offload.aio import (
    AioPlan,
    AsyncIO,
    AsyncIOError,
    IORequest,
    aligned_empty,
    probe_direct,
)
from zerospeed.offload.swap import BufferPool, SwapFile, check_nvme_path, slot_nbytes

__all__ = [
    "AioPlan",
    "AsyncIO",
    "AsyncIOError",
    "BufferPool",
    "IORequest",
    "SwapFile",
    "aligned_empty",
    "check_nvme_path",
    "probe_direct",
    "slot_nbytes",
]
