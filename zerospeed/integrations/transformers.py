"""The transformers Trainer on zerospeed: change one import line and keep `--deepspeed cfg.json`.

    from zerospeed.integrations.transformers import Trainer, TrainingArguments

See docs/transformers.md. The pieces: `hf_args` (arguments that never set up the deepspeed package),
`hf_trainer` (the Trainer that trains through the Engine), `hf_auto` (the "auto" rules and the
mismatch check, pure), `hf_zero3` (building and loading models sharded from the start).
"""

from zerospeed.integrations.hf_args import TrainingArguments
from zerospeed.integrations.hf_auto import check_mismatches, hf_auto_values, hidden_size_of, resolve_hf_config
from zerospeed.integrations.hf_trainer import EngineOptimizer, EngineScheduler, Trainer
from zerospeed.integrations.hf_zero3 import from_pretrained_zero3, is_zero3_sharded

__all__ = [
    "EngineOptimizer",
    "EngineScheduler",
    "Trainer",
    "TrainingArguments",
    "check_mismatches",
    "from_pretrained_zero3",
    "hf_auto_values",
    "hidden_size_of",
    "is_zero3_sharded",
    "resolve_hf_config",
]
