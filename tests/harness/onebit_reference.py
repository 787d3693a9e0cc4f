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


def simulate_compressed_allreduce(
    tensors: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor]
) -> torch.Tensor:
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

    def __init__(
        self,
        params: list[torch.Tensor],
        world: int,
        *,
        lr: float,
        freeze_step: int,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        padded,
    ):
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
                self.m[i] = mean[: p.numel()].view_as(p)
            c1, c2 = 1 - self.b1**self.t, 1 - self.b2**self.v_updates
            p -= self.lr * self.m[i] / (c1 * ((self.v[i] / c2).sqrt() + self.eps))


def _denom(v: torch.Tensor, t: int, k: int, betas, eps: float) -> torch.Tensor:
    """Bias-corrected c1 (sqrt(v / c2) + eps) for step t and k updates of v."""
    b1, b2 = betas
    return (1 - b1**t) * ((v / (1 - b2 ** max(k, 1))).sqrt() + eps)


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x.reshape(-1), torch.zeros(n - x.numel())])


class ZeroOneAdamReference:
    """0/1 Adam over W virtual ranks (bias-corrected; no weight decay): variance rounds on a doubling
    schedule, 1-bit gradient means between them, then local steps synchronised on a doubling schedule."""

    def __init__(
        self,
        params,
        world: int,
        *,
        lr: float,
        var_freeze_step: int,
        var_update_scaler: int,
        local_step_scaler: int,
        local_step_clipper: int,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        padded,
    ):
        self.params, self.world, self.lr = params, world, lr
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.betas, self.eps = betas, eps
        self.n = [padded(p.numel(), world) for p in params]
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.local_p = [[p.detach().clone() for p in params] for _ in range(world)]  # each rank's own copy
        self.local_m = [[torch.zeros_like(p) for p in params] for _ in range(world)]
        self.u = [[torch.zeros_like(p) for p in params] for _ in range(world)]
        self.lrs = [0.0] * world
        self._fresh_errors()
        self.t, self.k = 0, 0
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0
        self.frozen = False

    def _fresh_errors(self):
        self.worker = [[torch.zeros(n) for _ in range(self.world)] for n in self.n]
        self.server = [[torch.zeros(n // self.world) for _ in range(self.world)] for n in self.n]

    def full_round_next(self) -> bool:
        """Whether the next step's gradients are all-reduced (the engine's backward all-reduce is on)."""
        return not self.frozen and (self.t + 1) % self.var_interval == 0

    @torch.no_grad()
    def step(self, rank_grads) -> None:
        b1, b2 = self.betas
        self.t += 1
        W = self.world
        if not self.frozen:
            full = self.t % self.var_interval == 0
            if full:
                self.k += 1
            for i, p in enumerate(self.params):
                if full:
                    g = sum(rank_grads[r][i] for r in range(W)) / W
                    self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                else:
                    mean = simulate_compressed_allreduce(
                        [_pad(rank_grads[r][i], self.n[i]) for r in range(W)], self.worker[i], self.server[i]
                    )
                    g = mean[: p.numel()].view_as(p)
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                p -= self.lr * self.m[i] / _denom(self.v[i], self.t, self.k, self.betas, self.eps)
            for r in range(W):  # every rank's copy is the common one during this stage
                self.local_p[r] = [p.detach().clone() for p in self.params]
                self.local_m[r] = [m.clone() for m in self.m]
            if full:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            if self.t > self.var_freeze_step:
                self.frozen = True
                self._fresh_errors()
            return
        sync = self.t % self.local_interval == 0
        for r in range(W):
            self.lrs[r] += self.lr
            for i in range(len(self.params)):
                self.local_m[r][i] = b1 * self.local_m[r][i] + (1 - b1) * rank_grads[r][i]
                d = _denom(self.v[i], self.t, self.k, self.betas, self.eps)
                step = -self.lr * self.local_m[r][i] / d
                self.local_p[r][i] += step
                self.u[r][i] += step
        if sync:
            for i, p in enumerate(self.params):
                d = _denom(self.v[i], self.t, self.k, self.betas, self.eps)
                mean = simulate_compressed_allreduce(
                    [_pad(self.u[r][i] * d, self.n[i]) for r in range(W)], self.worker[i], self.server[i]
                )[: p.numel()].view_as(p)
                for r in range(W):
                    self.local_p[r][i] = self.local_p[r][i] - self.u[r][i] + mean / d
                    self.local_m[r][i] = mean / -self.lrs[r]
                    self.u[r][i] = torch.zeros_like(p)
            self.lrs = [0.0] * W
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:
            self.local_counter, self.local_interval = 0, min(self.local_step_clipper, self.local_interval * 2)

    def rank_params(self, r: int):
        """Rank r's parameters (they differ between synchronisations of the local-step stage)."""
        return self.local_p[r]


class OneBitLambReference:
    """1-bit LAMB over W virtual ranks (bias-corrected; no weight decay; DeepSpeed's clipping constants)."""

    def __init__(
        self,
        params,
        world: int,
        *,
        lr: float,
        freeze_step: int,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        max_coeff=10.0,
        min_coeff=0.01,
        coeff_beta=0.9,
        factor_max=4.0,
        factor_min=0.5,
        factor_threshold=0.1,
        padded,
    ):
        self.params, self.world, self.lr, self.freeze_step = params, world, lr, freeze_step
        self.betas, self.eps = betas, eps
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.v_fresh = [torch.zeros_like(p) for p in params]
        self.frozen_coeff = [0.0] * len(params)
        self.last_factor = [1.0] * len(params)
        self.scaling = None
        total = sum(p.numel() for p in params)
        self.n = padded(total, world)
        self.worker = [torch.zeros(self.n) for _ in range(world)]
        self.server = [torch.zeros(self.n // world) for _ in range(world)]
        self.t = self.k = 0

    @torch.no_grad()
    def step(self, rank_grads) -> None:
        b1, b2 = self.betas
        W = self.world
        self.t += 1
        if self.t <= self.freeze_step:
            self.k += 1
            for i, p in enumerate(self.params):
                g = sum(rank_grads[r][i] for r in range(W)) / W
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                if self.t == self.freeze_step:
                    self.v_fresh[i] = self.v[i].clone()
                u = self.m[i] / _denom(self.v[i], self.t, self.k, self.betas, self.eps)
                w_norm, u_norm = float(p.norm()), float(u.norm())
                c = min(max(w_norm / u_norm, self.min_coeff), self.max_coeff) if w_norm and u_norm else 1.0
                if c != 1.0:
                    self.frozen_coeff[i] = self.coeff_beta * self.frozen_coeff[i] + (1 - self.coeff_beta) * c
                p -= self.lr * c * u
            return
        if self.scaling is None:
            scales = [float(m.norm()) / math.sqrt(m.numel()) for m in self.m]
            united = sum(scales) / len(scales)
            self.scaling = [united / s if s > 0 else 1.0 for s in scales]
        prev = [m.clone() for m in self.m]
        flats = [
            _pad(
                torch.cat(
                    [
                        ((b1 * m + (1 - b1) * rank_grads[r][i]) * self.scaling[i]).reshape(-1)
                        for i, m in enumerate(self.m)
                    ]
                ),
                self.n,
            )
            for r in range(W)
        ]
        mean = simulate_compressed_allreduce(flats, self.worker, self.server)
        offset = 0
        for i, p in enumerate(self.params):
            self.m[i] = mean[offset : offset + p.numel()].view_as(p) / self.scaling[i]
            offset += p.numel()
            g = (self.m[i] - b1 * prev[i]) / (1 - b1)
            self.v_fresh[i] = b2 * self.v_fresh[i] + (1 - b2) * g * g
            denom = _denom(self.v[i], self.t, self.k, self.betas, self.eps)
            update = self.m[i] / denom
            f = float((denom / _denom(self.v_fresh[i], self.t, self.t, self.betas, self.eps)).max())
            f = min(max(f, self.factor_min), self.factor_max)
            last = self.last_factor[i]
            f = min(max(f, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
            self.last_factor[i] = f
            p -= self.lr * self.frozen_coeff[i] * f * update
