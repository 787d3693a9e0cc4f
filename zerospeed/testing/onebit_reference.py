"""Single-process references for the 1-bit optimizers' tests: W virtual ranks in one process.

Written from the formulas (arXiv 2102.02888, section 4; docs/comm_compression.md), with plain float
signs and no packing, padding or collectives, so a test compares zerospeed's packed, distributed
implementation with an independent computation of the same mathematics.
"""
from __future__ import annotations

import math

import torch


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))


def _rms(x: torch.Tensor) -> float:
    return math.sqrt(float((x.double() ** 2).sum()) / x.numel())


def simulate_compressed_allreduce(tensors: list[torch.Tensor], worker_errors: list[torch.Tensor],
                                  server_errors: list[torch.Tensor]) -> torch.Tensor:
    """The 1-bit mean of W ranks' flat `tensors` (all padded to the same length, a multiple of W);
    updates each rank's worker error (full length) and server error (its chunk) in place."""
    world = len(tensors)
    compressed = []
    for k in range(world):
        x = tensors[k] + worker_errors[k]
        scale = _rms(x)
        worker_errors[k].copy_(x - scale * _sign(x))
        compressed.append(scale * _sign(x))
    chunks = [c.chunk(world) for c in compressed]
    out = []
    for r in range(world):
        y = sum(chunks[k][r] for k in range(world)) / world + server_errors[r]
        scale = _rms(y)
        server_errors[r].copy_(y - scale * _sign(y))
        out.append(scale * _sign(y))
    return torch.cat(out)


class OneBitAdamReference:
    """1-bit Adam over W virtual ranks' gradients (bias-corrected, as zerospeed's default; no weight decay)."""

    def __init__(self, params: list[torch.Tensor], world: int, *, lr: float, freeze_step: int,
                 betas=(0.9, 0.999), eps: float = 1e-8, padded):
        self.params, self.world, self.lr, self.freeze_step = params, world, lr, freeze_step
        self.b1, self.b2 = betas
        self.eps = eps
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.padded = [padded(p.numel(), world) for p in params]
        self.worker = [[torch.zeros(n) for _ in range(world)] for n in self.padded]
        self.server = [[torch.zeros(n // world) for _ in range(world)] for n in self.padded]
        self.t = 0
        self.v_updates = 0

    @torch.no_grad()
    def step(self, rank_grads: list[list[torch.Tensor]]) -> None:
        """`rank_grads[k][i]`: virtual rank k's local gradient of parameter i."""
        self.t += 1
        compressing = self.t > self.freeze_step
        if not compressing:
            self.v_updates += 1
        for i, p in enumerate(self.params):
            if not compressing:
                g = sum(rank_grads[k][i] for k in range(self.world)) / self.world
                self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
                self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            else:
                local = []
                for k in range(self.world):
                    mk = (self.b1 * self.m[i] + (1 - self.b1) * rank_grads[k][i]).reshape(-1)
                    local.append(torch.cat([mk, torch.zeros(self.padded[i] - p.numel())]))
                mean = simulate_compressed_allreduce(local, self.worker[i], self.server[i])
                self.m[i] = mean[:p.numel()].view_as(p)
            c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.v_updates
            p -= self.lr * self.m[i] / (c1 * ((self.v[i] / c2).sqrt() + self.eps))
