"""Peak dense FLOP/s of known devices, for MFU (model FLOPs utilisation).

Values are the vendors' datasheet dense 16-bit tensor-core peaks (no sparsity). A CPU has no entry:
its peak depends on cores, clocks and vector units, so the user passes `peak_flops` instead.
"""

from __future__ import annotations

import torch

# Matched as a case-insensitive substring of torch.cuda.get_device_name(); first match wins, so
# more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("T4", 65e12),
)


def peak_flops_for(device_name: str) -> float | None:
    """The table's peak for a device name, or None when it is unknown."""
    lower = device_name.lower()
    for key, value in PEAK_BF16_FLOPS:
        if key.lower() in lower:
            return value
    return None


def current_device_peak() -> float | None:
    """Peak FLOP/s of this process's CUDA device, or None (CPU or unknown GPU)."""
    if not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name())
