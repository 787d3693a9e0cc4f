"""DeepSpeed's ``deepspeed.compression``: quantization-aware training and pruning, driven by the
``compression_training`` config block (see docs/compression.md for what is built)."""
from zerospeed.compression.compress import init_compression, redundancy_clean, student_initialization
from zerospeed.compression.config import CompressionConfig, parse_compression_config
from zerospeed.compression.scheduler import compression_scheduler

__all__ = ["CompressionConfig", "compression_scheduler", "init_compression", "parse_compression_config",
           "redundancy_clean", "student_initialization"]
