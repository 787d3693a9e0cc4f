"""Run at interpreter start by the shim's `deepspeed_zerospeed.pth` (only where the shim is installed).

It imports nothing heavy: it only arranges for `accelerate.state` to be adjusted when (and if) it is
imported — Note [accelerate on a CPU-only machine] in zerospeed/compat/accelerate_cpu.py, through the
hooks of zerospeed/compat/import_hooks.py (Note [post-import hooks by name]).
"""

from zerospeed.compat.import_hooks import install_hook

install_hook()
