"""DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp` names, served by `zerospeed.sequence`."""
from zerospeed.sequence.data import UlyssesSPDataLoaderAdapter
from zerospeed.sequence.hf import UlyssesSPAttentionHF
from zerospeed.sequence.tiled import TiledMLP

__all__ = ["TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
