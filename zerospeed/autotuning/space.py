"""The tuning space, as DeepSpeed users write it: lists in the config mean "try each" (pure).

DeepSpeed's convention (deepspeed/autotuning README, "Configuring Tuning Scope"):

- ``zero_optimization.stage``: a number (only that stage), a list of stages, or ``"all"`` (0-3);
  without a ``zero_optimization`` block, stage 0.
- ``train_micro_batch_size_per_gpu``: a list (exactly those sizes), a number (the smallest size to
  try) or ``"auto"`` / absent (from ``autotuning.min_train_micro_batch_size_per_gpu``, or the script's
  value of the flag ``arg_mappings`` maps it to).
- zerospeed adds the offload device: ``zero_optimization.offload_optimizer.device`` (and
  ``offload_param.device``) may be a list such as ``["none", "cpu"]``.
- with ``autotuning.fast: false``, any other list-valued key of ``zero_optimization`` is a knob tried
  value by value (DeepSpeed's default bucket-size space is not copied: most of its keys change nothing
  in zerospeed, see docs/config_reference.md).

`split_space` separates those lists from the rest of the config; `candidates` expands them into
concrete `Candidate`s; `trial_config` writes one candidate back into a plain config. The micro-batch
ladder is geometric (doubling from the smallest size), not DeepSpeed's constant stride: a step's cost
changes with the log of the batch, and the sizes that fit are found by the estimator, not by trials.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from zerospeed.utils.errors import ConfigError

OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class Candidate:
    """One configuration to try: ZeRO stage, micro batch, accumulation steps, offload devices, knobs."""

    stage: int
    micro_batch: int
    gas: int = 1
    offload_optimizer: str = "none"
    offload_param: str = "none"
    knobs: tuple[tuple[str, Any], ...] = ()  # (zero_optimization key, value), fast: false only

    @property
    def name(self) -> str:
        """DeepSpeed's experiment name (``z1_tmbspg3_gas1``) plus offload devices and knobs."""
        parts = [f"z{self.stage}", f"tmbspg{self.micro_batch}", f"gas{self.gas}"]
        if self.offload_optimizer != "none":
            parts.append(f"offopt-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"offparam-{self.offload_param}")
        parts += [f"{key}-{_short(value)}" for key, value in self.knobs]
        return "_".join(parts)

    @property
    def variant(self) -> tuple:
        """Everything but the micro batch: what the search compares across micro batches."""
        return (self.stage, self.offload_optimizer, self.offload_param, self.knobs)

    @property
    def tier(self) -> tuple[int, int]:
        """Expected speed class, fastest first: (offload level, `traffic`). No offload, then optimizer
        offload (host transfers and a CPU step), then parameter offload (the weights cross every step);
        within each, the bytes the ZeRO stage moves per optimizer step."""
        offload = 2 if self.offload_param != "none" else 1 if self.offload_optimizer != "none" else 0
        return offload, traffic(self.stage, self.gas)


def traffic(stage: int, gas: int) -> int:
    """Bytes a ZeRO stage moves per optimizer step, in model sizes (ring collectives: all-reduce 2,
    reduce-scatter 1, all-gather 1), by zerospeed's reduction schedule: stage 0 all-reduces and stage 1
    reduce-scatters and all-gathers once, at the accumulation boundary; stage 2 reduce-scatters every
    micro-step; stage 3 also gathers the parameters for every forward and backward. At gas 1 that is
    the ZeRO paper's 2, 2, 2, 3; at gas 2 it is 2, 2, 3, 6."""
    return {0: 2, 1: 2, 2: gas + 1, 3: 3 * gas}[stage]


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return f"{value:.0e}".replace("+", "") if value >= 1e4 else str(int(value))
    return str(value)


@dataclass(frozen=True)
class TuningSpace:
    """The lists the user wrote, resolved: what `candidates` expands."""

    stages: tuple[int, ...]
    micro_batches: tuple[int, ...] | None  # an explicit list, or None: the ladder below
    min_micro_batch: int
    max_micro_batch: int
    gas: int
    num_micro_batches: int  # sizes per stage when the ladder is used
    min_train_batch: int = 1
    max_train_batch: int | None = None
    offload_optimizer: tuple[str, ...] = ("none",)
    offload_param: tuple[str, ...] = ("none",)
    knobs: tuple[tuple[str, tuple[Any, ...]], ...] = field(default_factory=tuple)


def _stages(zero: dict[str, Any]) -> tuple[int, ...]:
    stage = zero.get("stage", 0)
    values = [0, 1, 2, 3] if stage == "all" else stage if isinstance(stage, list) else [stage]
    if "all" in values:
        values = [0, 1, 2, 3]
    bad = [s for s in values if isinstance(s, bool) or s not in (0, 1, 2, 3)]
    if bad or not values:
        raise ConfigError(
            f'zero_optimization.stage={stage!r}: the autotuner takes a stage 0-3, a list of them, or "all"'
        )
    return tuple(sorted(set(values)))


def _devices(zero: dict[str, Any], key: str) -> tuple[str, ...]:
    block = zero.get(key)
    if not isinstance(block, dict):
        return ("none",)
    device = block.get("device", "none")
    values = device if isinstance(device, list) else [device]
    if not values or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"zero_optimization.{key}.device={device!r}: give a device or a list of devices")
    return tuple(dict.fromkeys(values))


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: expected a positive integer")
    return value


def split_space(
    raw: dict[str, Any], at, *, script_values: dict[str, Any] | None = None
) -> tuple[dict[str, Any], TuningSpace]:
    """(the config without its tuning lists, the space they describe). ``at`` is the parsed
    ``AutotuningConfig``; ``script_values`` the script's values of mapped arguments (by config key)."""
    script_values = script_values or {}
    base = copy.deepcopy(raw)
    zero = base.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError("zero_optimization must be an object")
    stages = _stages(zero)
    offload = {key: _devices(zero, key) for key in OFFLOAD_KEYS}
    knobs = tuple((k, tuple(v)) for k, v in zero.items() if isinstance(v, list) and k != "stage")
    if knobs and at.fast:
        names = ", ".join(f"zero_optimization.{k}" for k, _ in knobs)
        raise ConfigError(
            f"{names}: a list there is a knob to tune, which needs autotuning.fast: false "
            "(fast mode tunes only the ZeRO stage, the micro batch and listed offload devices)"
        )
    gas = _gas(base, script_values)
    micro = base.get("train_micro_batch_size_per_gpu", "auto")
    explicit = None
    minimum = at.min_train_micro_batch_size_per_gpu
    if isinstance(micro, list):
        explicit = tuple(sorted({_positive_int(m, "train_micro_batch_size_per_gpu") for m in micro}))
        if not explicit:
            raise ConfigError("train_micro_batch_size_per_gpu=[]: list at least one micro batch size")
    elif micro == "auto":
        if "train_micro_batch_size_per_gpu" in script_values:
            minimum = _positive_int(script_values["train_micro_batch_size_per_gpu"], "train_micro_batch_size_per_gpu")
    else:
        minimum = _positive_int(micro, "train_micro_batch_size_per_gpu")
    maximum = at.max_train_micro_batch_size_per_gpu
    for key in BATCH_KEYS:
        base.pop(key, None)
    for key in ("stage", *(k for k, _ in knobs)):
        zero.pop(key, None)
    for key in OFFLOAD_KEYS:  # the block's other keys (pin_memory, nvme_path, ...) stay for trial_config
        if isinstance(zero.get(key), dict):
            zero[key] = {k: v for k, v in zero[key].items() if k != "device"}
        else:
            zero.pop(key, None)
    if "zero_optimization" in base:
        base["zero_optimization"] = zero
    space = TuningSpace(
        stages,
        explicit,
        minimum,
        maximum,
        gas,
        at.num_tuning_micro_batch_sizes,
        at.min_train_batch_size,
        at.max_train_batch_size,
        offload["offload_optimizer"],
        offload["offload_param"],
        knobs,
    )
    return base, space


def _gas(raw: dict[str, Any], script_values: dict[str, Any]) -> int:
    gas = raw.get("gradient_accumulation_steps", "auto")
    if gas == "auto":
        gas = script_values.get("gradient_accumulation_steps", 1)
    if isinstance(gas, list):
        raise ConfigError("gradient_accumulation_steps: a list is not a tuning space (as in DeepSpeed); give one value")
    return _positive_int(gas, "gradient_accumulation_steps")


def micro_batches(space: TuningSpace, dp_size: int) -> list[int]:
    """The micro batches to consider: the explicit list or the ladder, within the train-batch bounds
    (``min_train_batch_size`` <= micro x gas x data-parallel size <= ``max_train_batch_size``)."""
    sizes = (
        list(space.micro_batches)
        if space.micro_batches
        else micro_batch_ladder(space.min_micro_batch, space.max_micro_batch)
    )
    lo, hi = space.min_train_batch, space.max_train_batch
    return [m for m in sizes if lo <= m * space.gas * dp_size and (hi is None or m * space.gas * dp_size <= hi)]


def micro_batch_ladder(minimum: int, maximum: int) -> list[int]:
    """minimum, 2 x minimum, 4 x minimum, ... up to maximum, and maximum itself."""
    if maximum < minimum:
        return []
    out = [minimum * 2**i for i in range(int(math.log2(maximum / minimum)) + 1)]
    out = [m for m in out if m <= maximum]
    return out if out[-1] == maximum else [*out, maximum]


def spread(sizes: list[int], n: int) -> list[int]:
    """``n`` of the ascending ``sizes``, evenly by position, always the smallest and the largest."""
    if n >= len(sizes) or not sizes:
        return list(sizes)
    if n == 1:
        return [sizes[-1]]
    picks = {round(i * (len(sizes) - 1) / (n - 1)) for i in range(n)}
    return [sizes[i] for i in sorted(picks)]


def valid(c: Candidate) -> bool:
    """Combinations zerospeed runs: optimizer offload from stage 1, parameter offload at stage 3 with
    the optimizer offloaded too (the estimator's rule)."""
    if c.offload_optimizer != "none" and c.stage == 0:
        return False
    return c.offload_param == "none" or (c.stage == 3 and c.offload_optimizer != "none")


def variants(space: TuningSpace) -> list[Candidate]:
    """Every valid (stage, offload, knobs) of the space, at micro batch 0 (a placeholder)."""
    knob_values = [[(key, v) for v in values] for key, values in space.knobs]
    out = []
    for stage, opt, param in itertools.product(space.stages, space.offload_optimizer, space.offload_param):
        for knobs in itertools.product(*knob_values):
            c = Candidate(stage, 0, space.gas, opt, param, tuple(knobs))
            if valid(c):
                out.append(c)
    return out


def with_micro_batch(c: Candidate, micro_batch: int) -> Candidate:
    return Candidate(c.stage, micro_batch, c.gas, c.offload_optimizer, c.offload_param, c.knobs)


def trial_config(base: dict[str, Any], c: Candidate, autotuning: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain config of one candidate: ``base`` with its stage, offload, knobs and batch keys."""
    cfg = copy.deepcopy(base)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = c.stage
    for key, device in (("offload_optimizer", c.offload_optimizer), ("offload_param", c.offload_param)):
        block = zero.pop(key, None)
        if device != "none":
            zero[key] = {**(block or {}), "device": device}
    for key, value in c.knobs:
        zero[key] = value
    cfg["train_micro_batch_size_per_gpu"] = c.micro_batch
    cfg["gradient_accumulation_steps"] = c.gas
    if autotuning is not None:
        cfg["autotuning"] = autotuning
    return cfg
