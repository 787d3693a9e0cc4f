"""What the three 1-bit optimizers share: the engine they steer and the compressed collective.

Note [the engine's backward all-reduce]: in their compressed stages these optimizers exchange the
momentum themselves (1-bit, `comm.compressed`), so the engine must not all-reduce the gradients first:
each rank's optimizer sees its own local gradient. DeepSpeed's optimizers switch the engine's
`enable_backward_allreduce` (a pipeline engine's `pipeline_enable_backward_allreduce`) off; zerospeed's
engines read the same attributes at every accumulation boundary. The optimizer is built before the
engine exists, so the engine calls `bind_engine(engine)` once it has one (DeepSpeed passes itself as
the `deepspeed` argument).

Note [1-bit bias correction]: DeepSpeed's 1-bit optimizers accept `bias_correction` (default true)
and ignore it: their update is m / (sqrt(v) + eps), which early in training is several times Adam's
step (at step 10 with the default betas, 6.5x). zerospeed honours the flag: with it, the denominator
is c1 (sqrt(v / c2) + eps), c1 = 1 - b1^t and c2 = 1 - b2^k for the k updates v has had (k stops
growing once v is frozen), so the warm-up is exactly Adam / LAMB, and every formula of the compressed
stages keeps its shape with that denominator. `"bias_correction": false` (as DeepSpeed's tutorials
set it) gives DeepSpeed's updates exactly.

Note [1-bit Adam under ZeRO-1/2]: DeepSpeed refuses ZeRO with its 1-bit optimizers; zerospeed runs
1-bit Adam at stages 1 and 2. The optimizer then steps this rank's flat master chunks. In the warm-up
the engine reduce-scatters as usual and the moments of a chunk are Adam's. From the first compressed
step on, every rank also keeps the whole layout's momentum (all-gathered once from the chunks): the
strategy leaves each rank its whole local gradient (Note [local gradients] in zero/sharded.py), the
momentum takes it in, each parameter's segment of it is averaged by the 1-bit all-reduce alone (with
its own errors, exactly as at stage 0), and the chunk's update reads its slice of the result: the
parameters are the same as stage 0's up to float rounding. What stays sharded is v and the fp32
masters; the per-step parameter all-gather of stage 1 stays too, so the compressed stage moves about
half of uncompressed ZeRO-1's bytes rather than 1/32 (docs/comm_compression.md). 0/1 Adam (its
local steps give every rank its own weights, which one owner per chunk cannot hold) and 1-bit LAMB
(a trust ratio per whole parameter, which a flat chunk cuts) are refused there, as are offloaded
optimizers and `exp_avg_mask` / `non_freeze` groups (their keys name model parameters, not chunks).

Other differences from DeepSpeed, on purpose: DeepSpeed's first `step()` only allocates buffers and
leaves the parameters alone; here the first step is a real step. The compression errors are not saved
in checkpoints and restart at zero after a load, as DeepSpeed does.
"""

from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.comm import backend
from zerospeed.comm.compressed import compressed_allreduce_many, error_buffers
from zerospeed.utils.errors import ConfigError

BACKENDS = ("nccl", "mpi", "compressed", "hccl", "gloo")
_ERROR_KEYS = ("worker_error", "server_error")


class OneBitOptimizer(torch.optim.Optimizer):
    """Base: engine binding, the backward all-reduce switch, and per-tensor compression errors."""

    name = "1-bit optimizer"
    # Note [1-bit Adam under ZeRO-1/2]: why not, for an optimizer that cannot run on flat chunks
    sharded_refusal: str | None = "it does not run on ZeRO's flat chunks"

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        deepspeed=None,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        amsgrad: bool = False,
    ):
        if amsgrad:
            raise ConfigError(f"{self.name} does not support the AMSGrad variant (optimizer.params.amsgrad)")
        if comm_backend_name not in BACKENDS:
            raise ConfigError(
                f"optimizer.params.comm_backend_name={comm_backend_name!r}: expected one of {BACKENDS} "
                "(every name runs the compressed all-reduce through the job's own backend)"
            )
        super().__init__(params, defaults)
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.deepspeed = None
        self.shards: dict = {}  # id(master chunk) -> its zero.reducer.GradUnit (ZeRO-1/2)
        self._full_m: dict = {}  # id(master chunk) -> the whole layout's momentum (ZeRO-1/2, compressed)
        self._segment_states: dict = {}  # (id(master chunk), parameter index) -> its compression errors
        self.group = None
        self.size = 1
        self.using_pipeline = False
        if deepspeed is not None:
            self.bind_engine(deepspeed)

    # -- the engine ------------------------------------------------------------------------------
    def bind_engine(self, engine) -> None:
        """Steer `engine` (Note [the engine's backward all-reduce]); its data-parallel group is the one
        compressed over."""
        zero = getattr(engine, "zero", None)
        self.group = engine.dp_group
        self.size = backend.get_world_size(self.group)
        if zero is not None and not zero.replicated_state:
            self._check_sharded(zero)
            self.shards = {id(m): u for m, u in zero.local_gradient_units()}
        self.deepspeed = engine
        self.using_pipeline = hasattr(engine, "pipeline_enable_backward_allreduce")
        self._set_backward_allreduce(not self.compressing())

    def _check_sharded(self, zero) -> None:
        """Note [1-bit Adam under ZeRO-1/2]: what a sharded engine must be for this optimizer."""
        where = f"{self.name} with zero_optimization.stage {zero.stage}"
        if zero.stage >= 3:
            raise ConfigError(
                f"{where}: stage 3 gathers every parameter from its shards in each forward, which "
                "costs more than the compression saves; use stage 0-2, or ZeRO++'s compressed "
                "collectives at stage 3 (zero_quantized_weights / zero_quantized_gradients, "
                "docs/comm_compression.md)"
            )
        if self.sharded_refusal is not None:
            raise ConfigError(
                f"{where}: not supported, {self.sharded_refusal}; use zero_optimization.stage 0, "
                "or OneBitAdam, which runs at stages 1 and 2"
            )
        plan = getattr(zero, "plan", None)
        if plan is not None and plan.optimizer != "none":
            raise ConfigError(
                f"{where}: zero_optimization.offload_optimizer is not supported (the compressed stage "
                "updates the momentum of the whole model on every rank); remove offload_optimizer"
            )
        for key in ("exp_avg_mask", "non_freeze"):
            if any(key in g for g in self.param_groups):
                raise ConfigError(
                    f"{where}: the param-group key {key!r} names model parameters, which ZeRO "
                    "flattens into chunks; use zero_optimization.stage 0 with it"
                )
        sizes = {u.world_size for _, u in zero.local_gradient_units()}
        if sizes - {self.size}:
            raise ConfigError(
                f"{where}: some parameters reduce over groups other than the data-parallel one "
                f"(sizes {sorted(sizes)} vs {self.size}: expert or tensor-parallel groups); use "
                "zero_optimization.stage 0"
            )

    def _set_backward_allreduce(self, enabled: bool) -> None:
        if self.deepspeed is None:
            return
        if self.shards:  # Note [local gradients] in zero/sharded.py
            self.deepspeed.zero.hold_local_gradients(not enabled)
        if self.using_pipeline:
            self.deepspeed.pipeline_enable_backward_allreduce = enabled
        else:
            self.deepspeed.enable_backward_allreduce = enabled

    def compressing(self) -> bool:
        """Whether the engine's gradients arrive unreduced (the compressed stage)."""
        raise NotImplementedError

    def _check_bound(self) -> None:
        if self.deepspeed is None and backend.is_initialized() and backend.get_world_size() > 1:
            raise RuntimeError(
                f"{self.name} was not bound to an engine: give it in the config's optimizer section "
                "(zerospeed.initialize builds and binds it), or call optimizer.bind_engine(engine)"
            )

    # -- compression -----------------------------------------------------------------------------
    def _errors(self, state: dict, numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if "worker_error" not in state:
            state["worker_error"], state["server_error"] = error_buffers(numel, self.size, device)
        return state["worker_error"], state["server_error"]

    def _allreduce(self, t: torch.Tensor, state: dict) -> torch.Tensor:
        """The 1-bit mean of `t` over the data-parallel ranks (unchanged on one rank)."""
        return self._allreduce_many([(t, state)])[0]

    def _allreduce_many(self, pairs: list[tuple[torch.Tensor, dict]]) -> list[torch.Tensor]:
        """`_allreduce` of every (tensor, its state), each compressed alone, in one set of collectives."""
        if self.size == 1 or not pairs:
            return [t for t, _ in pairs]
        errors = [self._errors(state, t.numel(), t.device) for t, state in pairs]
        return compressed_allreduce_many(
            [t for t, _ in pairs], [w for w, _ in errors], [s for _, s in errors], self.group
        )

    @staticmethod
    def _masked(t: torch.Tensor, group: dict) -> torch.Tensor:
        """DeepSpeed's `exp_avg_mask` param-group key: momentum entries known to stay zero."""
        mask = group.get("exp_avg_mask")
        return t if mask is None else t.mul_(mask.to(t.device))

    # -- ZeRO-1/2 (Note [1-bit Adam under ZeRO-1/2]) -------------------------------------------
    def _full_momentum(self, p: torch.Tensor, unit, chunk_m: torch.Tensor) -> torch.Tensor:
        """The whole layout's momentum of master chunk `p`, all-gathered from the chunks the first time."""
        full = self._full_m.get(id(p))
        if full is None:
            full = torch.empty(unit.layout.padded, dtype=chunk_m.dtype, device=chunk_m.device)
            comm.all_gather_into_tensor(full, chunk_m.reshape(-1).clone(), group=unit.group)
            self._full_m[id(p)] = full
        return full

    def _segments(self, p: torch.Tensor, unit, full: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
        """Each parameter's piece of a whole momentum, with the state holding its compression errors."""
        return [
            (full[s.offset : s.offset + s.numel], self._segment_states.setdefault((id(p), s.param), {}))
            for s in unit.layout.segments
        ]

    def unsaved_state_bytes(self) -> int:
        """Bytes held outside `self.state`: whole momenta (ZeRO-1/2) and per-segment errors. (The
        chunk's `exp_avg` is a view of its whole momentum: counted once, here.)"""
        full = sum(t.nbytes for t in self._full_m.values())
        views = sum(s["exp_avg"].nbytes for p, s in self.state.items() if id(p) in self._full_m)
        errors = sum(t.nbytes for s in self._segment_states.values() for t in s.values())
        return full - views + errors

    @staticmethod
    def _chunk_of(unit, full: torch.Tensor) -> torch.Tensor:
        lo, hi = unit.layout.chunk_range(unit.rank)
        return full[lo:hi]

    def reset_errors(self) -> None:
        for state in list(self.state.values()) + list(self._segment_states.values()):
            for key in _ERROR_KEYS:
                if key in state:
                    state[key].zero_()

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self):
        """Without the compression errors (per rank, padded; they restart at zero after a load)."""
        sd = super().state_dict()
        sd["state"] = {k: {n: v for n, v in s.items() if n not in _ERROR_KEYS} for k, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):  # the script's own mask wins
            if "exp_avg_mask" in group:
                saved["exp_avg_mask"] = group["exp_avg_mask"]
            else:
                saved.pop("exp_avg_mask", None)
        super().load_state_dict(state_dict)
        self._full_m.clear()  # rebuilt from the loaded chunks; the errors restart at zero
        self._segment_states.clear()
        self._after_load()
        self._set_backward_allreduce(not self.compressing())

    def _after_load(self) -> None:
        pass

    def _first_step(self) -> int:
        first = self.param_groups[0]["params"][0]
        return int(self.state[first].get("step", 0)) if first in self.state else 0

    def _steps_done(self) -> int:
        """Steps every parameter has taken. A sharded engine steps its chunks in sub-groups, one
        optimizer.step() each, and steps every chunk every step: a chunk with no state yet counts 0,
        so the stage switches only once the whole step is done. Unsharded, a parameter that never got
        a gradient (never stepped) does not hold the switch back."""
        if self.shards:
            return min(
                (
                    int(self.state[p].get("step", 0)) if p in self.state else 0
                    for g in self.param_groups
                    for p in g["params"]
                ),
                default=0,
            )
        return min((int(s["step"]) for s in self.state.values() if "step" in s), default=0)


def denominator(v: torch.Tensor, group: dict, step: int, v_updates: int, eps_inside_sqrt: bool = False) -> torch.Tensor:
    """Note [1-bit bias correction]: (sqrt(v) + eps), or c1 (sqrt(v / c2) + eps) with bias correction."""
    b1, b2 = group["betas"]
    eps = group["eps"]
    if group.get("bias_correction", True):
        c1, c2 = 1 - b1**step, 1 - b2 ** max(v_updates, 1)
        v = v / c2
    else:
        c1 = 1.0
    d = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt().add_(eps)
    return d.mul_(c1) if c1 != 1.0 else d


def decay(update: torch.Tensor, p: torch.Tensor, group: dict) -> torch.Tensor:
    """DeepSpeed's L2-style weight decay inside the update: update + weight_decay * p."""
    return update.add_(p, alpha=group["weight_decay"]) if group["weight_decay"] > 0 else update


def check_max_grad_norm(value) -> None:
    if value:
        raise ConfigError(
            "optimizer.params.max_grad_norm: not supported (DeepSpeed's 1-bit optimizers ignore it "
            "too); use the top-level gradient_clipping"
        )
