"""Shard-on-load for `init_inference(model, checkpoint=...)` on a model built on the meta device.

The loader is shared with training (`tp_model_init(..., checkpoint=...)`) and lives in
zerospeed/parallel/tensor/load.py; the inference engine shards the meta model for generation
(inference/tp.py) and then calls `load_shards` with the files of its `checkpoint` setting.
"""

from zerospeed.parallel.tensor.load import is_meta_model, load_shards

__all__ = ["is_meta_model", "load_shards"]
