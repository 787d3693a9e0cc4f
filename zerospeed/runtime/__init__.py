"""The engine layer: `initialize` (the config translated once into plans: plans.py), the engines (core.py, the
facade of DeepSpeed's methods deepspeed_api.py, engine.py, pipeline.py), step hooks (hooks.py); DeepSpeed's
`deepspeed.runtime` paths below it are aliases (deepspeed_paths.py)."""

from zerospeed.deepspeed_paths import package_getattr

__getattr__ = package_getattr(__name__)
