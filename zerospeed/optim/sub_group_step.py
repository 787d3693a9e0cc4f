"""The optimizer step every ZeRO stage shares: scale the gradients, step in sub-groups.

It lives in `optim/` (not `zero/` or `offload/`) because both build on it: the ZeRO strategies call a
stepper, and the NVMe stepper in `offload/` reuses `step_one`; imports run zero -> offload -> optim.

Two steppers with one interface: `InMemoryStepper` (masters and optimizer states resident, on the
device or — with `offload_optimizer.device: cpu` — in host memory) and
`zerospeed.offload.optimizer_swap.NvmeOptimizerSwapper` (masters and states live in swap files and
pass through a few host buffers, one sub-group at a time). A strategy hands either one its
(master, gradient) pairs and a callback that publishes a sub-group's updated masters to the
parameters while they are resident.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

OnStepped = Callable[[list[int]], None]


@torch.no_grad()
def step_in_sub_groups(
    optimizer: torch.optim.Optimizer,
    grads: list[tuple[torch.Tensor, torch.Tensor]],
    coef: float,
    sub_groups: list[list[int]] | None = None,
    on_stepped: OnStepped | None = None,
) -> None:
    """Multiply each (master, gradient) pair's gradient by `coef`, then step the optimizer.

    With `sub_groups` (lists of indices into `grads`) the optimizer steps one sub-group at a time:
    torch optimizers skip parameters whose .grad is None, so each step's temporaries cover at most
    `sub_group_size` elements. Gradients are attached only for the duration of their step.
    `on_stepped(indices)` runs after each sub-group's step.
    """
    scale_grads(grads, coef)
    for sub in sub_groups if sub_groups is not None else [list(range(len(grads)))]:
        step_one(optimizer, [grads[i] for i in sub])
        if on_stepped is not None:
            on_stepped(list(sub))


def scale_grads(grads: list[tuple[torch.Tensor, torch.Tensor]], coef: float) -> None:
    if coef != 1.0:
        for _, g in grads:
            g.mul_(coef)


def step_one(optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer.step() over exactly these (master, gradient) pairs."""
    for m, g in pairs:
        m.grad = g if g.dtype == m.dtype and g.device == m.device else g.to(m.device, m.dtype)
    optimizer.step()
    for m, _ in pairs:
        m.grad = None


class InMemoryStepper:
    """Masters and optimizer states stay resident; the step is `step_in_sub_groups`."""

    kind = "memory"

    def step(self, optimizer, grads, coef: float, sub_groups, on_stepped: OnStepped | None = None) -> None:
        step_in_sub_groups(optimizer, grads, coef, sub_groups, on_stepped)

    @contextlib.contextmanager
    def resident(self, optimizer) -> Iterator[None]:
        """Masters and states are always resident here."""
        yield

    def state_bytes_in_memory(self, optimizer) -> int | None:
        return None  # everything the optimizer holds is in memory

    def files(self) -> list:
        return []

    def close(self) -> None:
        pass


def use_fused_cpu_step(optimizer: torch.optim.Optimizer | None) -> None:
    """Offloaded Adam/AdamW steps with torch's fused CPU kernel: one pass over memory per flat
    sub-group instead of a pass per elementwise op (`benchmarks/cpu_adam.py` measures it). A
    `fused` or `foreach` the user set explicitly is kept."""
    if optimizer is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        if (
            group.get("fused") is None
            and not group.get("foreach")
            and not group.get("differentiable")
            and not group.get("capturable")
        ):
            group["fused"] = True
