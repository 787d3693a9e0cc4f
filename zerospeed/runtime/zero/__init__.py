"""DeepSpeed's `deepspeed.runtime.zero`: the ZeRO-3 user API at its DeepSpeed path (zerospeed/zero)."""
from zerospeed._lazy import lazy_submodules
from zerospeed.zero import GatheredParameters, Init, register_external_parameter

__getattr__ = lazy_submodules(__name__)
__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
