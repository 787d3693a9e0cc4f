"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters`: `Init`, `GatheredParameters`,
`register_external_parameter` and the `ZeroParamStatus` enum (with DeepSpeed's values)."""
import enum

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.zero import GatheredParameters, Init, register_external_parameter


class ZeroParamStatus(enum.Enum):
    NOT_AVAILABLE = 1  # sharded: only this rank's slice exists
    INFLIGHT = 2       # being gathered
    AVAILABLE = 3      # full


# DeepSpeed's Init patches torch's tensor constructors (torch.empty, torch.arange, ...) through this
# wrapper, and transformers swaps it while building a model (`prevent_arange_dtype_change`).
# zerospeed's Init builds modules for real and shards each as it is attached (zero/stage3/api.py):
# it patches no constructor, so the wrapper is the identity and swapping it changes nothing.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    return fn


__all__ = ["get_accelerator", "zero_wrapper_for_fp_tensor_constructor", "GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
