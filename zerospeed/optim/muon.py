"""Muon (MomentUm Orthogonalized by Newton-Schulz) with an auxiliary Adam, as DeepSpeed 0.19.8 builds it.

Per Muon matrix, with momentum ``m`` (zero-initialised) and the averaged gradient ``g``:

    m      = lerp(m, g, 1 - momentum)                    # m = momentum * m + (1 - momentum) * g
    u      = lerp(g, m, momentum)                        # Nesterov: the blend is what is orthogonalised
    O      = NS5(u) * sqrt(max(1, rows / cols))          # five Newton-Schulz steps, then the shape factor
    p      = p * (1 - lr * weight_decay) - lr * O

and for every other parameter DeepSpeed's inline Adam(W): ``exp_avg`` / ``exp_avg_sq`` lerps, bias
correction, ``update = m_hat / (sqrt(v_hat) + eps)``, decoupled weight decay (L2 with
``adam_w_mode: false``). Defaults are DeepSpeed's: Muon ``lr`` 0.02, ``momentum`` 0.95, ``weight_decay``
0, ``ns_method`` "gram"; Adam ``lr`` 3e-4, ``betas`` (0.9, 0.95), ``eps`` 1e-10, ``weight_decay`` 0.

Note [Newton-Schulz precision]: as DeepSpeed, the iteration runs in a reduced precision chosen per
method and accelerator (`ns_compute_dtype`): "gram" in fp16 where the accelerator has fp16 kernels
(every CUDA GPU from compute capability 7; a CPU only with oneDNN fp16), else fp32; "standard" in bf16
where supported (every CPU, CUDA from Ampere), else fp32. "standard" casts before normalising, "gram"
normalises in the input's dtype (fp32 for an fp16 input) and casts after. The quintic coefficients are
(3.4445, -4.7750, 2.0315); "gram" iterates on the Gram matrix ``X Xᵀ`` of the wide orientation and
restarts at step 2 (square matrices take the standard iteration in its dtype). A 4-D (convolution)
gradient is viewed as ``(out, -1)``; the shape factor still reads the gradient's last two dimensions,
which is DeepSpeed's arithmetic.

Note [Muon on ZeRO shards]: Newton-Schulz needs whole matrices, and ZeRO 1-3 hold 1/N of each flat
layout. The momentum and the Nesterov blend are element-wise, so each rank keeps its momentum for its
own chunk only (``state["momentum_buffer"]`` of the fp32 master chunk, as sharded as Adam's moments)
and blends in place; the strategy then all-gathers each Muon layout's blended chunk (one
``all_gather_into_tensor`` of the padded layout over its group: ``(N - 1) / N * padded * 4`` bytes on
the wire per rank for fp32 gradients), every rank orthogonalises the matrices that touch its chunk,
and writes its chunk of the update where the gradient was. The optimizer's step on a 1-D master then
only applies ``p * (1 - lr * wd) - lr * update``, as DeepSpeed's does on its flat partitions.
This runs after the overflow check (a skipped step leaves the momentum alone) and before the global
norm, which the engine then takes, and clips, over Muon's update and the Adam half's gradients: what
DeepSpeed's ZeRO 1-3 do (at ZeRO 0 the engine clips the gradient and Muon runs inside `step`).
DeepSpeed's ZeRO 1-2 instead all-reduce the gradient of every Muon matrix that straddles a partition
boundary and keep the *whole* momentum of every matrix a rank touches, and its ZeRO 3 all-gathers each
Muon matrix's gradient; the arithmetic is the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed.accelerator import get_accelerator

__all__ = [
    "MUON_KEYS",
    "ADAM_KEYS",
    "NS_METHODS",
    "MuonWithAuxAdam",
    "ShardedLayout",
    "adam_update",
    "muon_update",
    "ns_compute_dtype",
    "uses_muon",
    "zeropower_via_gram_newtonschulz",
    "zeropower_via_newtonschulz5",
]

NS_METHODS = ("standard", "gram")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")  # what a Muon half of a param group takes
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")  # and an Adam half
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
_GRAM_RESTART = 2


def uses_muon(name: str, ndim: int) -> bool:
    """DeepSpeed's rule at `initialize`: matrices (2+ dimensions as a layer) whose name holds neither
    "embed" nor "lm_head" (case-insensitive) train with Muon, everything else with Adam."""
    lowered = name.lower()
    return ndim >= 2 and "embed" not in lowered and "lm_head" not in lowered


def ns_compute_dtype(ns_method: str = "gram") -> torch.dtype:
    """Note [Newton-Schulz precision]: the dtype the iteration runs in, on this accelerator."""
    acc = get_accelerator()
    if ns_method == "gram":
        return torch.float16 if acc.is_fp16_supported() else torch.float32
    return torch.bfloat16 if acc.is_bf16_supported() else torch.float32


def _wide(x: torch.Tensor) -> bool:
    return x.size(-2) > x.size(-1)


def zeropower_via_newtonschulz5(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration (cast first, then normalise to spectral norm <= 1)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(ns_compute_dtype("standard"))
    if _wide(g):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        a_ = x @ x.mT
        x = a * x + (b * a_ + c * a_ @ a_) @ x
    return x.mT if _wide(g) else x


def zeropower_via_gram_newtonschulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The same iteration on the small Gram matrix R = X Xᵀ, restarted at step 2 (normalise, then cast)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
    if _wide(g):
        x = x.mT
    n, m = x.size(-2), x.size(-1)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(ns_compute_dtype("gram"))
    if m <= n:  # square: no saving, the standard iteration (in this method's dtype)
        for _ in range(steps):
            a_ = x @ x.mT
            x = a * x + (b * a_ + c * a_ @ a_) @ x
        return x.mT if _wide(g) else x
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == _GRAM_RESTART:
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return x.mT @ q.mT if _wide(g) else q @ x


def _aspect_ratio_scale(rows: int, cols: int) -> float:
    return math.sqrt(rows / cols) if rows > cols else 1.0


def orthogonalize(update: torch.Tensor, grad_shape: torch.Size, ns_method: str, ns_steps: int = 5) -> torch.Tensor:
    """Newton-Schulz of a Nesterov blend, times the shape factor of `grad_shape`, in the blend's dtype."""
    dtype, shape = update.dtype, update.shape
    if update.ndim == 4:  # convolution filters
        update = update.view(len(update), -1)
    ns = zeropower_via_gram_newtonschulz if ns_method == "gram" else zeropower_via_newtonschulz5
    out = ns(update, ns_steps)
    out *= _aspect_ratio_scale(grad_shape[-2], grad_shape[-1])
    return out.to(dtype).reshape(shape)  # (DeepSpeed returns a 4-D filter's update 2-D, and fails on it)


def muon_update(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    beta: float = 0.95,
    ns_steps: int = 5,
    nesterov: bool = True,
    ns_method: str = "gram",
    is_expert_group: bool = False,
    num_heads: int | None = None,
) -> torch.Tensor:
    """DeepSpeed's `muon_update` on a whole matrix: updates `momentum` (and, with nesterov, `grad`) in
    place, returns the orthogonalised update. A non-finite gradient leaves the momentum as it was and
    is returned itself, so an overflow stays visible. `is_expert_group` (a batch of expert matrices)
    takes the same batched iteration; per-head Muon (`num_heads`) is not implemented."""
    if num_heads is not None:
        raise NotImplementedError("muon_update: per-head Muon (num_heads) is not implemented in zerospeed")
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    out = orthogonalize(update, grad.shape, ns_method, ns_steps)
    return torch.where(finite, out, grad)


def adam_update(grad, exp_avg, exp_avg_sq, step: int, betas, eps: float) -> torch.Tensor:
    """DeepSpeed's inline Adam direction (moments updated in place)."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.lerp_(grad.square(), 1 - betas[1])
    return (exp_avg / (1 - betas[0] ** step)) / ((exp_avg_sq / (1 - betas[1] ** step)).sqrt() + eps)


@dataclass
class ShardedLayout:
    """One flat layout of a parameter group as one rank holds it (Note [Muon on ZeRO shards])."""

    master: torch.Tensor  # this rank's fp32 master chunk: the optimizer's parameter
    grad: torch.Tensor  # this rank's reduced gradient chunk; receives the update
    shapes: list[tuple[torch.Size, int, int]]  # per parameter: full shape, offset and numel in the layout
    start: int  # this chunk's first element in the layout
    gather: Callable[[torch.Tensor], torch.Tensor]  # a chunk -> the whole padded layout, rank order


class MuonWithAuxAdam(torch.optim.Optimizer):
    """DeepSpeed's `MuonWithAuxAdam`: one optimizer for the whole model, Muon for the param groups with
    ``use_muon=True``, its inline Adam(W) for those with ``use_muon=False`` (every group must say which).

    A Muon parameter with 2+ dimensions is orthogonalised here; a 1-D one is a ZeRO flat chunk whose
    gradient `orthogonalize_shards` already turned into the update. Parameters without a gradient are
    skipped (DeepSpeed steps them with a zero gradient; the engine always hands every chunk one).
    Groups may carry other keys (DeepSpeed adds ``name``); they are kept.
    """

    def __init__(
        self,
        param_groups: Iterable[dict[str, Any]],
        adam_optimizer: Any = None,
        adam_optimizer_kwargs: dict[str, Any] | None = None,
        adam_w_mode: bool = True,
        fallback_to_inline: bool = False,
    ) -> None:
        # DeepSpeed's signature. Its engine passes FusedAdam / torch's AdamW / DeepSpeedCPUAdam as the Adam
        # half's optimizer, all of them this inline arithmetic; here the Adam half is always the inline one.
        del adam_optimizer, adam_optimizer_kwargs, fallback_to_inline
        groups = [dict(g) for g in param_groups]
        for g in groups:
            if "use_muon" not in g:
                raise ValueError("MuonWithAuxAdam: every param group needs a 'use_muon' key (True or False)")
            for key, value in (MUON_DEFAULTS if g["use_muon"] else ADAM_DEFAULTS).items():
                g.setdefault(key, value)
            if g["use_muon"]:
                if g["ns_method"] not in NS_METHODS:
                    raise ValueError(f"ns_method must be one of {NS_METHODS}, got {g['ns_method']!r}")
                # (DeepSpeed sorts a Muon group by size for its round-robin; the order changes nothing here)
            else:
                g["betas"] = tuple(g["betas"])
        self.adam_w_mode = adam_w_mode
        super().__init__(groups, {})

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    @torch.no_grad()
    def orthogonalize_shards(self, layouts: list[ShardedLayout], scale: float = 1.0) -> None:
        """Note [Muon on ZeRO shards]: turn each Muon layout's gradient chunk into its update chunk, times
        `scale` (the loss scale the gradient carries, so that unscaling treats both alike; the momentum
        takes the gradient as it is, as DeepSpeed's does). Collective: every rank of a layout's group
        calls this with the same layouts in the same order."""
        for lay in layouts:
            group = self._group_of(lay.master)
            if not group["use_muon"]:
                continue
            state = self.state[lay.master]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(lay.grad)
            momentum, beta = state["momentum_buffer"], group["momentum"]
            momentum.lerp_(lay.grad, 1 - beta)
            full = lay.gather(lay.grad.lerp_(momentum, beta))
            chunk = lay.grad.numel()
            for shape, offset, numel in lay.shapes:
                lo, hi = max(offset, lay.start), min(offset + numel, lay.start + chunk)
                if lo >= hi:
                    continue
                whole = orthogonalize(full[offset : offset + numel].view(shape), shape, group["ns_method"])
                piece = whole.reshape(-1)[lo - offset : hi - offset]
                lay.grad[lo - lay.start : hi - lay.start].copy_(piece if scale == 1.0 else piece * scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon_step if group["use_muon"] else self._adam_step)(p, group)
        return loss

    def _muon_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.dim() < 2:  # a ZeRO chunk: the gradient already is the update
            update = p.grad
        else:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            update = muon_update(p.grad, state["momentum_buffer"], group["momentum"], ns_method=group["ns_method"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.reshape(p.shape), alpha=-group["lr"])

    def _adam_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        grad = p.grad if self.adam_w_mode else p.grad.add(p, alpha=group["weight_decay"])
        state = self.state[p]
        if len(state) == 0:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = 0
        state["step"] += 1
        update = adam_update(grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["betas"], group["eps"])
        if self.adam_w_mode:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"])


def muon_param_groups(
    groups: list[dict[str, Any]],
    flags: dict[int, bool],
    params: dict[str, Any],
) -> list[dict[str, Any]]:
    """Split each param group into its Muon and Adam halves, as DeepSpeed's engine does.

    `flags`: id(parameter) -> uses Muon (`uses_muon`). Settings resolve most-specific-last: the
    config's shared value (``lr``, ``momentum``, ...), then ``muon_lr`` / ``adam_lr``, then what the
    group itself sets; other keys of a group are dropped, as DeepSpeed drops them. A half gets
    ``use_muon`` and DeepSpeed's ``name`` ("muon-params", or "<group name or groupN>-muon-params" with
    several groups); an empty half is dropped.
    Raises KeyError naming a parameter without a flag.
    """
    halves = ((True, "muon", MUON_KEYS, "muon_lr"), (False, "adam", ADAM_KEYS, "adam_lr"))
    out = []
    for index, group in enumerate(groups):
        overrides = {k: v for k, v in group.items() if k not in ("params", "use_muon", "name")}
        for use_muon, label, keys, lr_key in halves:
            half = [p for p in group["params"] if flags[id(p)] is use_muon]
            if not half:
                continue
            settings = {k: params[k] for k in keys if k in params}
            if lr_key in params:
                settings["lr"] = params[lr_key]
            settings.update({k: v for k, v in overrides.items() if k in keys})
            prefix = group.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append({"params": half, "use_muon": use_muon, "name": name, **settings})
    return out
