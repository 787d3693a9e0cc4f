"""The training engine (engine.py, core.py), `initialize`, data loading; DeepSpeed's `deepspeed.runtime`."""
from zerospeed.deepspeed_paths import package_getattr

__getattr__ = package_getattr(__name__)
