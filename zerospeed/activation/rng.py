"""Random-number state for exact recompute, and DeepSpeed's model-parallel RNG tracker.

The recompute in backward must draw the same random numbers as the original forward (the same
dropout masks), and must not disturb the random stream of everything that runs after it. So the
forward records a snapshot (host generator, the accelerator generator of every device involved, and
the tracker's named states); the recompute runs inside ``replay(snapshot)``, which installs it and
restores the outer state afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from zerospeed.accelerator import get_accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"


# -- accelerator generator access (zerospeed.accelerator holds the device specifics) -------------


def device_rng_state(device: torch.device) -> torch.Tensor:
    return get_accelerator().get_rng_state(device.index)


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    get_accelerator().set_rng_state(state, device.index)


def current_accelerator_device() -> torch.device | None:
    """The accelerator device this process computes on, or None on a host-only accelerator."""
    device = torch.device(get_accelerator().current_device_name())
    return None if device.type == "cpu" else device


def _tracked_get() -> torch.Tensor:
    """The generator the tracker forks: the accelerator's, or the host's on a CPU-only run."""
    device = current_accelerator_device()
    return torch.get_rng_state() if device is None else device_rng_state(device)


def _tracked_set(state: torch.Tensor) -> None:
    device = current_accelerator_device()
    if device is None:
        torch.set_rng_state(state)
    else:
        set_device_rng_state(state, device)


def _tracked_seed(seed: int) -> None:
    get_accelerator().manual_seed(seed)


# -- the model-parallel tracker --------------------------------------------------------------------


class RngStatesTracker:
    """Named generator states; ``fork(name)`` runs a block on that stream and saves where it ended.

    Model-parallel ranks share the default stream (same dropout on replicated activations) but draw
    from a per-rank stream for partitioned ones.
    """

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self._states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed`` without disturbing the current stream."""
        if name in self._states:
            raise ValueError(f"RNG tracker: stream {name!r} already exists; reset() the tracker first")
        outer = _tracked_get()
        _tracked_seed(seed)
        self._states[name] = _tracked_get()
        _tracked_set(outer)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            raise ValueError(f"RNG tracker: no stream {name!r}; add it first (model_parallel_cuda_manual_seed)")
        outer = _tracked_get()
        _tracked_set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _tracked_get()
            _tracked_set(outer)


TRACKER = RngStatesTracker()


# -- snapshots for recompute ------------------------------------------------------------------------


@dataclass(frozen=True)
class RngSnapshot:
    """Host, per-device and tracker generator states at one moment."""

    host: torch.Tensor
    devices: tuple[tuple[torch.device, torch.Tensor], ...]
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, devices: Iterable[torch.device], tracker: RngStatesTracker = TRACKER) -> RngSnapshot:
        return cls(torch.get_rng_state(), tuple((d, device_rng_state(d)) for d in devices), tracker.get_states())

    def restore(self, tracker: RngStatesTracker = TRACKER) -> None:
        torch.set_rng_state(self.host)
        for device, state in self.devices:
            set_device_rng_state(state, device)
        tracker.set_states(self.tracker)


def rng_devices(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """Accelerator devices whose generators a function over ``tensors`` may draw from."""
    found = {t.device for t in tensors if t.device.type != "cpu"}
    current = current_accelerator_device()
    if current is not None:
        found.add(current)
    return tuple(sorted(found, key=str))


@contextlib.contextmanager
def replay(snapshot: RngSnapshot, tracker: RngStatesTracker = TRACKER) -> Iterator[None]:
    """Run a block with ``snapshot``'s generator states, then put the outer states back."""
    outer = RngSnapshot.capture((d for d, _ in snapshot.devices), tracker)
    snapshot.restore(tracker)
    try:
        yield
    finally:
        outer.restore(tracker)


def model_parallel_manual_seed(seed: int, model_parallel_rank: int) -> None:
    """DeepSpeed/Megatron seeding: the default stream gets ``seed`` (same on all model-parallel ranks),
    the tracker's model-parallel stream gets ``seed + 2718 + rank`` (different per rank)."""
    TRACKER.reset()
    _tracked_seed(seed)
    TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + model_parallel_rank)
