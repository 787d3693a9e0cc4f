"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing`: random layerwise token dropping
(random-LTD) — the schedule (`scheduler`), the layer wrapper (`basic_layer`) and the user API (`helper`)."""
from zerospeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from zerospeed.runtime.data_pipeline.data_routing.helper import (convert_to_random_ltd, remove_random_ltd_state_dict,
                                                                 save_without_random_ltd)
from zerospeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

__all__ = ["RandomLTDScheduler", "RandomLayerTokenDrop", "convert_to_random_ltd", "remove_random_ltd_state_dict",
           "save_without_random_ltd"]
