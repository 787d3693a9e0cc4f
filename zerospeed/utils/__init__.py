"""DeepSpeed's `deepspeed.utils` names that zerospeed provides (loaded on first use: the logger
needs no torch, the tensor accessors do)."""
import importlib

from zerospeed.utils.logging import log_dist, logger

_LAZY = {
    "RepeatingLoader": "zerospeed.runtime.dataloader",
    **{name: "zerospeed.utils.tensor_fragment" for name in (
        "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
        "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_local_fp32_param",
        "safe_set_local_optimizer_state", "safe_set_full_grad", "safe_set_local_grad")},
    **{name: "zerospeed.utils.z3_leaf_module" for name in (
        "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
        "z3_leaf_parameter")},
}

__all__ = ["log_dist", "logger", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule, as `deepspeed.utils.X` reaches it
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
