"""DeepSpeed's (and Megatron's) memory-mapped indexed files: the on-disk format of the data analyzer's
results and of the curriculum sampler's clusters (`prefix.bin` + `prefix.idx`).

A file holds a list of 1-D integer arrays ("items") of one dtype:

* `prefix.bin`: the items' elements, back to back, little-endian, no header.
* `prefix.idx`: the 9-byte magic `MMIDIDX\\0\\0`, version `<Q` = 1, the dtype code `<B` (1 uint8,
  2 int8, 3 int16, 4 int32, 5 int64, 6 uint16, 7 uint32, 8 uint64), the item count `<Q`, the document
  count `<Q`, then the items' sizes (int32 each), their byte offsets into `.bin` (int64 each), and the
  document index (int64 each: 0, then the item count at the end of each document; closing a file ends
  its last document, so a file written in one go has `[0, n]` and DeepSpeed's merged analyzer files,
  one document per merged chunk and one more at the close, `[0, c1, ..., n, n]`).

Files written here are byte for byte what DeepSpeed's `MMapIndexedDatasetBuilder` writes for the same
items, and DeepSpeed's `MMapIndexedDataset` reads them (and we read its files).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.uint16): 6,
    np.dtype(np.uint32): 7,
    np.dtype(np.uint64): 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def fit_int_dtype(low: int, high: int) -> np.dtype:
    """The smallest integer dtype holding every value in [low, high] (unsigned when low >= 0), as
    DeepSpeed's analyzer picks the dtype of sample indices and metric values."""
    kinds = (np.uint8, np.uint16, np.uint32, np.uint64) if low >= 0 else (np.int8, np.int16, np.int32, np.int64)
    for kind in kinds:
        info = np.iinfo(kind)
        if info.min <= low and high <= info.max:
            return np.dtype(kind)
    return np.dtype(kinds[-1])


class IndexedWriter:
    """Writes `prefix.bin` item by item; `close()` ends the last document and writes `prefix.idx`."""

    def __init__(self, prefix: str | os.PathLike, dtype) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"indexed files hold integers only ({sorted(map(str, DTYPE_CODES))}), got {self.dtype}")
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin = open(self.prefix + ".bin", "wb")  # noqa: SIM115 (closed by close())
        self._sizes: list[int] = []
        self._docs: list[int] = [0]

    def add(self, values) -> None:
        """Append one item: the values of `values` (any shape, flattened), cast to the file's dtype."""
        arr = np.ascontiguousarray(np.asarray(values).reshape(-1).astype(self.dtype, copy=False))
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (the items since the last one)."""
        self._docs.append(len(self._sizes))

    def close(self) -> None:
        self.end_document()
        self._bin.close()
        sizes = np.array(self._sizes, dtype=np.int64)
        offsets = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            offsets[1:] = np.cumsum(sizes[:-1] * self.dtype.itemsize)
        docs = np.array(self._docs, dtype=np.int64)
        with open(self.prefix + ".idx", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(offsets.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_indexed(prefix: str | os.PathLike, items: Iterable, dtype) -> None:
    """Write `items` (1-D integer arrays) as the indexed file `prefix`."""
    with IndexedWriter(prefix, dtype) as w:
        for item in items:
            w.add(item)


class IndexedFile:
    """Reads an indexed file: `len(f)` items, `f[i]` the i-th as a numpy array, `f[i:j]` a list of them."""

    def __init__(self, prefix: str | os.PathLike, skip_warmup: bool = True) -> None:
        """`skip_warmup`: DeepSpeed's argument (it pre-reads the file); pages are read on demand here."""
        self.prefix = str(prefix)
        with open(self.prefix + ".idx", "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if head[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{self.prefix}.idx is not a DeepSpeed/Megatron mmap index file (bad magic)")
        pos = len(MAGIC)
        (version,) = struct.unpack_from("<Q", head, pos)
        if version != 1:
            raise ValueError(f"{self.prefix}.idx: index version {version}, expected 1")
        (code,) = struct.unpack_from("<B", head, pos + 8)
        count, docs = struct.unpack_from("<QQ", head, pos + 9)
        self.dtype = CODE_DTYPES[code]
        index = np.memmap(self.prefix + ".idx", mode="r", dtype=np.uint8)
        base = len(head)
        self.sizes = np.frombuffer(index, dtype=np.int32, count=count, offset=base)
        self.offsets = np.frombuffer(index, dtype=np.int64, count=count, offset=base + 4 * count)
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=docs, offset=base + 12 * count)
        size = os.path.getsize(self.prefix + ".bin")
        self._data = np.memmap(self.prefix + ".bin", mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} of {len(self)} in {self.prefix}")
        return np.frombuffer(self._data, dtype=self.dtype, count=int(self.sizes[i]), offset=int(self.offsets[i]))

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        return os.path.exists(f"{prefix}.idx") and os.path.exists(f"{prefix}.bin")
