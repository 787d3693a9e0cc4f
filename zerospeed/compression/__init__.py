"""DeepSpeed's ``deepspeed.compression``: quantization-aware training (weights, activations, down to
ternary / binary), pruning (sparse, row, head, channel), layer reduction and distillation, driven by
the ``compression_training`` config block, and compressed model files (see docs/compression.md)."""

from zerospeed.compression.compress import init_compression, redundancy_clean, student_initialization
from zerospeed.compression.config import CompressionConfig, parse_compression_config
from zerospeed.compression.distill import distillation_loss, layerwise_distill
from zerospeed.compression.scheduler import compression_scheduler
from zerospeed.compression.storage import load_compressed, save_compressed

__all__ = [
    "CompressionConfig",
    "compression_scheduler",
    "distillation_loss",
    "init_compression",
    "layerwise_distill",
    "load_compressed",
    "parse_compression_config",
    "redundancy_clean",
    "save_compressed",
    "student_initialization",
]
