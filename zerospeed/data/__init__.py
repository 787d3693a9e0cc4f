"""Data and the data-side training techniques: the sharded training loader (loader.py), DeepSpeed's
legacy curriculum learning (curriculum.py), progressive layer dropping (progressive_layer_drop.py) and
random layerwise token dropping (random_ltd/). The engine attaches the techniques as step hooks."""
