"""Every random-number generator a training step may draw from, captured and restored per rank.

The states are stored as tensors, ints and tuples only, so shard files load with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from zerospeed.accelerator import get_accelerator


def capture_rng_state() -> dict:
    """Python `random`, numpy's global generator, torch's CPU generator and (on CUDA) this device's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    acc = get_accelerator()
    if acc.name == "cuda":
        state["cuda"] = acc.get_rng_state(acc.current_device())
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state` (a CUDA state is ignored on a CPU run and vice versa)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    acc = get_accelerator()
    if "cuda" in state and acc.name == "cuda":
        acc.set_rng_state(state["cuda"], acc.current_device())
