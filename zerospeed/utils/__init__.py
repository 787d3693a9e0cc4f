"""Foundation helpers every layer may use: logging, the ConfigError type, ports, small tensor helpers.

DeepSpeed's `deepspeed.utils` also exports ZeRO's tensor accessors and leaf-module helpers and the
RepeatingLoader; those live with their concepts and are served here by the alias table
(`deepspeed_paths.NAMES`, Note [the alias layer]).
"""

from zerospeed.deepspeed_paths import NAMES, package_getattr
from zerospeed.utils.logging import log_dist, logger

__all__ = ["log_dist", "logger", *sorted(NAMES[__name__])]
__getattr__ = package_getattr(__name__)
