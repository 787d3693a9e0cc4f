"""Checking config ``params`` dicts against a constructor's signature, and name suggestions.

Shared by the optimizer and scheduler factories so both report bad keys the same way: the dotted
config path of each offending key plus the list of accepted keys.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from zerospeed.utils.errors import ConfigError


def constructor_params(cls: Callable[..., Any], skip: int = 1) -> tuple[dict[str, inspect.Parameter], bool]:
    """Named parameters of ``cls.__init__`` after the first ``skip`` (``params`` / ``optimizer``),
    and whether it also takes ``**kwargs`` (then any key is accepted)."""
    sig = inspect.signature(cls)  # bound: ``self`` is already gone
    named: dict[str, inspect.Parameter] = {}
    var_kw = False
    for i, (name, p) in enumerate(sig.parameters.items()):
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif p.kind is not inspect.Parameter.VAR_POSITIONAL and i >= skip:
            named[name] = p
    return named, var_kw


def check_params(
    params: dict[str, Any],
    cls: Callable[..., Any],
    prefix: str,
    *,
    extra_accepted: Iterable[str] = (),
    skip: int = 1,
) -> None:
    """Raise ``ConfigError`` naming ``<prefix>.<key>`` for unknown keys and missing required ones.

    ``extra_accepted`` lists keys the caller already consumed (DeepSpeed-only knobs) so they
    appear among the accepted keys in the message.
    """
    named, var_kw = constructor_params(cls, skip)
    accepted = sorted(set(named) | set(extra_accepted))
    unknown = [k for k in params if k not in named]
    if unknown and not var_kw:
        keys = ", ".join(f"{prefix}.{k}" for k in unknown)
        raise ConfigError(f"{keys}: not accepted by {_name(cls)}; accepted params: {accepted}")
    missing = [n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in params]
    if missing:
        keys = ", ".join(f"{prefix}.{k}" for k in missing)
        raise ConfigError(f"{keys}: required by {_name(cls)} but missing; accepted params: {accepted}")


def closest_names(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Case-insensitive close matches of ``name`` among ``choices``, in their own spelling."""
    by_lower = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.5)
    return [by_lower[h] for h in hits]


def _name(cls: Callable[..., Any]) -> str:
    return getattr(cls, "__name__", repr(cls))


def check_common_hyperparams(
    name: str, *, lr: float, betas: tuple[float, float], weight_decay: float, eps: float | None = None
) -> None:
    """The range checks every Adam-family optimizer makes, with messages naming the optimizer."""
    if not lr >= 0.0:
        raise ValueError(f"{name}: invalid lr {lr} (must be >= 0)")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: invalid betas[{i}] {beta} (must be in [0, 1))")
    if eps is not None and not eps >= 0.0:
        raise ValueError(f"{name}: invalid eps {eps} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"{name}: invalid weight_decay {weight_decay} (must be >= 0)")


def refuse_no_bias_correction(name: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(
            f"{name}(bias_correction=False) is not supported: torch's Adam always bias-corrects; "
            "drop the argument (DeepSpeed's default is True)"
        )
