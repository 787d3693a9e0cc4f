"""Sequence parallelism (DeepSpeed-Ulysses) at DeepSpeed's path `deepspeed.sequence`.

`layer.DistributedAttention` (the all-to-all attention), `data` (each rank's slice of every sequence,
DeepSpeed's `UlyssesSPDataLoaderAdapter`), `loss` (the exact cross-rank mean), `tiled` (ALST's tiled MLP
and tiled logits + loss), `hf` (transformers models by config: `UlyssesSPAttentionHF`). docs/sequence_parallel.md.
"""

from zerospeed.deepspeed_paths import package_getattr

__getattr__ = package_getattr(__name__)
