"""Byte-level datasets that need no download: the demo trains on Python's own source code.

Tokens are bytes (vocabulary 256), so no tokenizer is needed and any machine with Python
installed has the same-shaped corpus. Its exact content depends on the Python version.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["stdlib_corpus", "stdlib_source_files", "ByteSequenceDataset", "random_token_dataset", "text_batches"]

logger = logging.getLogger(__name__)

# Third-party packages installed next to the standard library would make the corpus depend
# on what happens to be installed; only the interpreter's own modules are used.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root``, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    return [root / rel for rel in _source_files(str(root))]


@functools.lru_cache(maxsize=4)
def _source_files(root: str) -> tuple[str, ...]:
    """Relative posix paths of the ``.py`` files under ``root``, sorted. Listed once per process: every
    training test builds its batches from the corpus, and the walk (13k files, excluded directories
    pruned rather than walked and filtered) is the costly part. Directory links are followed, as a
    recursive glob does."""
    found = []
    for parent, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        rel = Path(parent).relative_to(root).as_posix()
        found += [
            n if rel == "." else f"{rel}/{n}"
            for n in names
            if n.endswith(".py") and os.path.isfile(os.path.join(parent, n))
        ]
    return tuple(sorted(found))


def stdlib_corpus(max_bytes: int = 4_000_000, root: Path | None = None) -> torch.Tensor:
    """The concatenated bytes of the standard library's sources as int64 token ids (0..255).

    Files are read in sorted order and the result is cut at ``max_bytes``, so two calls on the
    same Python installation return identical tensors.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    buf = bytearray()
    for path in stdlib_source_files(root):
        buf += path.read_bytes()
        if len(buf) >= max_bytes:
            break
    if not buf:
        raise FileNotFoundError(f"no .py files found under {root or sysconfig.get_paths()['stdlib']}")
    del buf[max_bytes:]
    logger.debug("stdlib corpus: %d bytes", len(buf))
    return torch.frombuffer(buf, dtype=torch.uint8).to(torch.int64)


class ByteSequenceDataset(Dataset):
    """Next-token pairs from non-overlapping windows of a 1-D token tensor.

    Item ``i`` is ``(x_T, y_T)`` with ``x_T = tokens[i*T : i*T+T]`` and ``y_T`` the same window
    shifted one token to the right. The last target needs one token past the window, hence
    ``len = (len(tokens) - 1) // T``.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.numel()}")
        self.tokens = tokens.to(torch.int64)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for dataset of length {len(self)}")
        start = (i % len(self)) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


def random_token_dataset(n: int, seq_len: int, vocab: int = 256, seed: int = 0) -> ByteSequenceDataset:
    """A dataset of exactly ``n`` items over seeded uniform-random tokens, for fast tests."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n * seq_len + 1,), generator=gen, dtype=torch.int64)
    return ByteSequenceDataset(tokens, seq_len)


def text_batches(steps: int, batch: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` consecutive global batches ``(x_BT, y_BT)`` of ``batch`` windows of the stdlib corpus.

    Real text (a loss that can fall, unlike uniform random tokens), read in order: batch ``s`` holds
    windows ``s*batch .. (s+1)*batch - 1`` of ``ByteSequenceDataset(stdlib_corpus(...), seq_len)``.
    """
    ds = ByteSequenceDataset(stdlib_corpus(max_bytes=steps * batch * seq_len + 1), seq_len)
    windows = ds.tokens[: steps * batch * seq_len + 1]
    xs = windows[:-1].view(steps, batch, seq_len)
    ys = windows[1:].view(steps, batch, seq_len)
    return [(xs[s].clone(), ys[s].clone()) for s in range(steps)]


def left_padded_prompts(lengths: tuple[int, ...], vocab: int, pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded with `pad` to the longest: (input_ids, attention_mask).
    Tokens are drawn from [2, vocab) (0 and 1 stay free for pad / bos / eos)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(2, vocab, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask
