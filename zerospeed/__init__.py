"""zerospeed: DeepSpeed-compatible distributed training for PyTorch, in pure Python.

    engine, optimizer, loader, scheduler = zerospeed.initialize(args=args, model=model, ...)
    loss = engine(batch); engine.backward(loss); engine.step()

Public names are loaded on first use, so `import zerospeed.launcher` (the `zerospeed` command)
starts without importing torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "zerospeed.runtime.initialize",
    "add_config_arguments": "zerospeed.runtime.initialize",
    "Engine": "zerospeed.runtime.engine",
    "DeepSpeedEngine": "zerospeed.runtime.engine",
    "init_distributed": "zerospeed.comm",
    "ConfigError": "zerospeed.config.errors",
    "RepeatingLoader": "zerospeed.runtime.dataloader",
    "tp_model_init": "zerospeed.parallel.tensor.autotp",
    "init_inference": "zerospeed.inference.api",
}
_SUBMODULES = {"comm", "config", "optim", "precision", "runtime", "testing", "launcher", "accelerator", "utils",
               "zero", "checkpoint", "checkpointing", "offload", "integrations", "inference", "moe", "sequence",
               "parallel", "elasticity"}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"zerospeed.{name}")
    raise AttributeError(f"module 'zerospeed' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
