"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing`: random layerwise token dropping
(random-LTD) — the schedule (`scheduler`), the layer wrapper (`basic_layer`) and the user API (`helper`)."""

from zerospeed.data.random_ltd.helper import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from zerospeed.data.random_ltd.layer import RandomLayerTokenDrop
from zerospeed.data.random_ltd.scheduler import RandomLTDScheduler

__all__ = [
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "convert_to_random_ltd",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
]
