"""ZenFlow's plan, schedule and host worker: the parts of ZenFlow that know nothing of ZeRO's layouts.

ZenFlow (arXiv 2505.12242; DeepSpeed's `zero_optimization.zenflow`) splits each weight matrix of an
offloaded optimizer by columns. After a gradient step the columns whose gradients are largest (the
top `topk_ratio` of each matrix by the L1 norm of their column of the gradient) are *selected*: they
are stepped on the device at every step by a small AdamW with its own moments. Every gradient is also
summed into a host accumulator, and every `update_interval` steps the host optimizer steps the whole
master copy with the interval's mean gradient; the columns that are not selected take its result. With
`overlap_step` the host step runs in a background thread while the next steps compute, and its result
is published one interval late. Vectors (biases, norms) count as wholly selected, as in DeepSpeed.
The strategy that drives this over ZeRO's flat chunks is `zerospeed.zero.zenflow`; the rule itself is
stated step by step in Note [the ZenFlow step] there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ZenFlowPlan:
    """`zero_optimization.zenflow`, resolved once (the engine's plans translate the config into it)."""

    topk_ratio: float = 0.1
    """Fraction of each matrix's columns stepped on the device at every step."""
    select_interval: int = 0
    """Steps (after warm-up) between column re-selections; 0: select once, at the first ZenFlow step."""
    update_interval: int = 0
    """Steps per host step; 0: "auto" (Note [auto update interval])."""
    auto_ratio: float = 0.99
    """"auto": the fraction of matrices whose unselected gradient must have caught up to end an interval."""
    full_warm_up_rounds: int = 0
    """The first steps are plain offloaded steps of everything (no selection)."""
    overlap_step: bool = False
    """Run the host step in a background thread; its result is published at the end of the next interval."""
    offload: bool = False
    """Keep the selected columns' optimizer moments in host memory (they are on the device otherwise)."""

    @property
    def auto_update(self) -> bool:
        return self.update_interval == 0


def matrix_shape(shape: torch.Size) -> tuple[int, int, bool]:
    """(rows, columns, whole) of a parameter seen as a matrix: a tensor of two or more dimensions is
    (shape[0], the rest); a vector or scalar is one row that is always wholly selected."""
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) >= 2 and numel > 0:
        return shape[0], numel // shape[0], False
    return 1, numel, True


def top_columns(column_norms: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending) of the int(ratio * columns) columns with the largest norms."""
    k = int(ratio * column_norms.numel())
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=column_norms.device)
    return torch.topk(column_norms, k).indices.sort().values


class AutoInterval:
    """Note [auto update interval]: with `update_interval: "auto"` an interval ends when, for at least
    `auto_ratio` of the matrices, the L1 mass of the gradient the host has accumulated outside the
    selected columns (per unselected fraction) reaches the interval's mean L1 mass of the selected
    columns' gradient (per selected fraction). DeepSpeed measures the same two sums per matrix (its
    `non_critic_sum` and `avg_critic_sum`); this is its comparison with the normalisations written out
    (DeepSpeed divides both sides by a further 10). A model without matrices steps the host every step."""

    def __init__(self, n_matrices: int, topk_ratio: float, auto_ratio: float):
        self.n, self.topk, self.ratio = n_matrices, topk_ratio, auto_ratio
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.critic = [0.0] * self.n
        self.rest = [0.0] * self.n

    def observe(self, selected_l1: list[float], total_l1: list[float]) -> bool:
        """Add one step's per-matrix L1 sums; True when the interval ends with this step."""
        self.steps += 1
        caught_up = 0
        for i, (sel, tot) in enumerate(zip(selected_l1, total_l1)):
            self.critic[i] += sel
            self.rest[i] += tot - sel
            mean_critic = self.critic[i] / self.steps / max(self.topk, 1e-12)
            caught_up += self.rest[i] / max(1.0 - self.topk, 1e-12) >= mean_critic
        return self.n == 0 or caught_up >= int(self.ratio * self.n)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "critic": list(self.critic), "rest": list(self.rest)}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.critic, self.rest = int(state["steps"]), list(state["critic"]), list(state["rest"])


class HostStepWorker:
    """One background thread that runs the host optimizer step (Note [ZenFlow's host thread] in
    zero/zenflow.py). `submit` starts a step, `wait` joins it and re-raises its error on the caller."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()

        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 — handed to the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="zenflow-host-step", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"ZenFlow's host optimizer step failed: {error}") from error
