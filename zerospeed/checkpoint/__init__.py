"""Model checkpoints (DeepSpeed's `deepspeed.checkpoint`): sharded save/load that reshards to any world size and
ZeRO stage, crash-safe writes,
and consolidation to one fp32 state dict (safetensors or torch) without processes.

The engine's `save_checkpoint` / `load_checkpoint` / `save_16bit_model` methods call the functions
of the same names here with a `TrainingState` (state.py): the state they save, never the engine.
See docs/checkpoints.md for the file layout and guarantees. Not to be confused with `zerospeed.activation`
(DeepSpeed's `deepspeed.checkpointing`): *activation*
checkpointing, which recomputes activations in backward instead of storing them.
"""

from zerospeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.load import load_checkpoint
from zerospeed.checkpoint.save import save_16bit_model, save_checkpoint, without_frozen
from zerospeed.checkpoint.state import TrainingState

__all__ = [
    "CheckpointError",
    "TrainingState",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "without_frozen",
]
