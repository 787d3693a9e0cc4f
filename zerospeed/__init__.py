"""zerospeed: DeepSpeed-compatible distributed training for PyTorch, in pure Python.

    engine, optimizer, loader, scheduler = zerospeed.initialize(args=args, model=model, ...)
    loss = engine(batch); engine.backward(loss); engine.step()

Public names are loaded on first use, so `import zerospeed.launcher` (the `zerospeed` command)
starts without importing torch. DeepSpeed's module paths (`zerospeed.runtime.lr_schedules`, ...)
are served by the alias table in deepspeed_paths.py (Note [the alias layer]).
"""

from __future__ import annotations

import importlib
import pkgutil

from zerospeed import deepspeed_paths
from zerospeed.version import __version__

deepspeed_paths.install()

_EXPORTS = {
    "initialize": "zerospeed.runtime.initialize",
    "add_config_arguments": "zerospeed.runtime.initialize",
    "Engine": "zerospeed.runtime.engine",
    "DeepSpeedEngine": "zerospeed.runtime.engine",
    "init_distributed": "zerospeed.comm",
    "ConfigError": "zerospeed.utils.errors",
    "RepeatingLoader": "zerospeed.data.loader",
    "tp_model_init": "zerospeed.parallel.tensor.autotp",
    "init_inference": "zerospeed.inference.api",
    # DeepSpeed's root names (deepspeed.X through the shim)
    "get_accelerator": "zerospeed.accelerator",
    "OnDevice": "zerospeed.utils.on_device",
    "DeepSpeedConfig": "zerospeed.config.deepspeed",
    "DeepSpeedConfigError": "zerospeed.utils.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]
_submodule = deepspeed_paths.package_getattr(__name__)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    return _submodule(name)  # a package (`zerospeed.comm`) or DeepSpeed path (`zerospeed.pipe`)


def __dir__():
    packages = {m.name for m in pkgutil.iter_modules(__path__)}
    aliases = {key.partition(".")[0] for key in deepspeed_paths.MODULES}
    return sorted(set(globals()) | set(_EXPORTS) | packages | aliases)
