"""DeepSpeed compatibility: `import deepspeed` and the `deepspeed` command, served by zerospeed.

`zerospeed-compat install` installs a small distribution named `deepspeed` (zerospeed/compat/shim)
whose package maps every `deepspeed.X.Y` to `zerospeed.X.Y` (alias.py). transformers, accelerate,
peft and TRL then find "DeepSpeed" and drive zerospeed through their own DeepSpeed code paths.
See docs/compat.md for the design and its trade-offs.
"""

from zerospeed.compat.alias import DEEPSPEED_API_VERSION, activate, deepspeed_is_shim, foreign_deepspeeds, is_shim

__all__ = ["DEEPSPEED_API_VERSION", "activate", "deepspeed_is_shim", "foreign_deepspeeds", "is_shim"]
