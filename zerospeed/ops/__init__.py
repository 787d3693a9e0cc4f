"""DeepSpeed's `deepspeed.ops` path: sparse attention (and, through the alias table, the optimizers and the
quantizer, which live in zerospeed.optim and zerospeed.precision: there are no compiled ops)."""

from zerospeed.deepspeed_paths import package_getattr

__getattr__ = package_getattr(__name__)
