"""The training engine (engine.py, core.py), `initialize`, data loading; DeepSpeed's `deepspeed.runtime`."""
from zerospeed._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__)
