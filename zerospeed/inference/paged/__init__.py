"""A pure-PyTorch paged KV cache (fixed-size blocks, a block table per sequence) and a continuous-batching
server for Llama-family models. See docs/inference.md."""

from zerospeed.inference.paged.blocks import BlockAllocator, OutOfBlocks, blocks_needed
from zerospeed.inference.paged.cache import PagedKVCache
from zerospeed.inference.paged.scheduler import Scheduler, Sequence
from zerospeed.inference.paged.server import PagedServer, TokenEvent

__all__ = [
    "BlockAllocator",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedServer",
    "Scheduler",
    "Sequence",
    "TokenEvent",
    "blocks_needed",
]
