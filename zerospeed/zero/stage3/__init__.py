"""ZeRO stage 3: sharded parameters, zero.Init, GatheredParameters."""

from zerospeed.zero.stage3.api import GatheredParameters, Init, register_external_parameter
from zerospeed.zero.tags import full_numel, full_shape

__all__ = ["GatheredParameters", "Init", "full_numel", "full_shape", "register_external_parameter"]
