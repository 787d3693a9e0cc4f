"""Batch-size resolution: DeepSpeed's rules for train_batch_size, micro batch and accumulation.

``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``
where ``world_size`` is the data-parallel world size. Any two determine the third; one alone
(train or micro) sets the accumulation steps to 1.
"""

from __future__ import annotations

from collections.abc import Collection

from zerospeed.utils.errors import ConfigError

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
WORLD = "data-parallel world size"


def _check_positive(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _all_three(train: int, micro: int, gas: int, world: int) -> None:
    product = micro * gas * world
    if train == product:
        return
    hints = [f"{TRAIN} to {product}"]
    if train % (micro * world) == 0:
        hints.append(f"{GAS} to {train // (micro * world)}")
    if train % (gas * world) == 0:
        hints.append(f"{MICRO} to {train // (gas * world)}")
    raise ConfigError(
        f"{TRAIN} {train} != {MICRO} {micro} * {GAS} {gas} * {WORLD} {world} = {product}; "
        f"change them together, e.g. set {', or '.join(hints)}; "
        "or give only two of the three and the third is derived"
    )


def _divide(train: int, divisor: int, divisor_text: str, derived: str) -> int:
    if train % divisor:
        raise ConfigError(
            f"{TRAIN} {train} is not divisible by {divisor_text} = {divisor}, so {derived} "
            f"cannot be derived; choose {TRAIN} as a multiple of {divisor} or set {derived} as well"
        )
    return train // divisor


def _derive(train: int | None, micro: int | None, gas: int | None, world: int) -> tuple[int, int, int]:
    if train is not None and micro is not None:
        gas = _divide(train, micro * world, f"{MICRO} {micro} * {WORLD} {world}", GAS)
        return train, micro, gas
    if train is not None and gas is not None:
        micro = _divide(train, gas * world, f"{GAS} {gas} * {WORLD} {world}", MICRO)
        return train, micro, gas
    if micro is not None and gas is not None:
        return micro * gas * world, micro, gas
    if train is not None:
        return train, _divide(train, world, f"{WORLD} {world}", MICRO), 1
    if micro is not None:
        return micro * world, micro, 1
    given = f"only {GAS} is set" if gas is not None else "none of the batch sizes is set"
    raise ConfigError(f"{given}; set {TRAIN} or {MICRO} (or both), optionally with {GAS}")


def _auto_note(auto_keys: Collection[str]) -> str:
    if not auto_keys:
        return ""
    keys = ", ".join(auto_keys)
    return (
        f' ({keys} {"was" if len(auto_keys) == 1 else "were"} "auto" and could not be derived '
        "from the other batch keys; set numbers or pass them as known values)"
    )


def resolve_batch_size(
    train_batch_size: int | None,
    micro_batch: int | None,
    grad_acc: int | None,
    world_size: int,
    *,
    auto_keys: Collection[str] = (),
) -> tuple[int, int, int]:
    """Return ``(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)``.

    Follows DeepSpeed's ``_set_batch_related_parameters`` and ``_batch_assertion``: all three
    given must satisfy ``train == micro * gas * world_size``; two given derive the third (the
    division must be exact); train alone gives gas 1 and micro ``train / world_size``; micro
    alone gives gas 1 and train ``micro * world_size``; otherwise it is an error.
    ``auto_keys`` names keys that were ``"auto"`` so an error can say they could not be derived.
    """
    _check_positive(WORLD, world_size)
    for name, value in ((TRAIN, train_batch_size), (MICRO, micro_batch), (GAS, grad_acc)):
        _check_positive(name, value)
    try:
        if None not in (train_batch_size, micro_batch, grad_acc):
            _all_three(train_batch_size, micro_batch, grad_acc, world_size)
            return train_batch_size, micro_batch, grad_acc
        return _derive(train_batch_size, micro_batch, grad_acc, world_size)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{_auto_note(auto_keys)}") from None
