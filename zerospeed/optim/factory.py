"""Build the basic optimizer from DeepSpeed's ``optimizer`` config section or a client optimizer.

Names, as in DeepSpeed: the DeepSpeed optimizers are matched case-insensitively ("Adam", "AdamW",
"Lamb", "Lion", "Adagrad"; we add "SGD"); any other name must be a ``torch.optim`` class spelled
exactly ("RMSprop", "NAdam", ...).

Note [Adam / AdamW mapping]: DeepSpeed's "Adam" is FusedAdam with ``adam_w_mode`` (default
True), i.e. decoupled weight decay = ``torch.optim.AdamW``; ``adam_w_mode: false`` gives L2
decay = ``torch.optim.Adam``; "AdamW" is always decoupled. FusedAdam's ``weight_decay`` defaults
to 0 while torch AdamW's defaults to 0.01, so an unset ``weight_decay`` is passed as 0 — unless
``torch_adam: true``, with which DeepSpeed itself builds torch's class with torch's defaults.
DeepSpeed-only knobs with no meaning here (``torch_adam``, ``adam_w_mode``, ``set_grad_none``,
``bias_correction: true``) are consumed; ``bias_correction: false`` is refused, torch's Adam
always corrects. ``fused`` / ``foreach`` are torch's own and pass through.

Note [client optimizer wins]: as in DeepSpeed, a client optimizer (instance, or callable(params))
takes precedence and ``optimizer.type`` is then ignored (we log a warning).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerospeed.optim import onebit
from zerospeed.optim._kwargs import check_params, closest_names
from zerospeed.optim.adagrad import DeepSpeedCPUAdagrad
from zerospeed.optim.adam import DeepSpeedCPUAdam, FusedAdam
from zerospeed.optim.lamb import Lamb
from zerospeed.optim.lion import DeepSpeedCPULion, FusedLion, Lion
from zerospeed.optim.muon import ADAM_KEYS, MUON_KEYS, NS_METHODS, MuonWithAuxAdam, muon_param_groups
from zerospeed.optim.param_groups import trainable_param_groups
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

__all__ = ["ZERO_TESTED_OPTIMIZERS", "build_optimizer", "is_zero_tested_optimizer", "optimizer_for_groups"]

# Element-wise optimizers: exact on a ZeRO shard. LAMB is not (its trust ratio needs the whole
# tensor's norms, see Note [LAMB on ZeRO shards]); exact type match, as DeepSpeed does.
ZERO_TESTED_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.SGD,
    Lion,
    # DeepSpeed's own element-wise optimizers, which its ZERO_SUPPORTED_OPTIMIZERS lists (its offload
    # refuses a client optimizer that is not its CPU Adam/Lion: Note [forced CPU optimizer], runtime/initialize.py)
    FusedAdam,
    DeepSpeedCPUAdam,
    DeepSpeedCPUAdagrad,
    FusedLion,
    DeepSpeedCPULion,
    # Muon runs on ZeRO shards through the strategies (Note [Muon on ZeRO shards], optim/muon.py)
    MuonWithAuxAdam,
)

# DeepSpeed's muP optimizers.
_NOT_IMPLEMENTED = {
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}

# Muon's keys (optim/muon.py): each half's settings, the per-half learning rates, and what DeepSpeed's
# auxiliary Adam consumes (torch_adam picks torch's AdamW there: the same arithmetic).
_MUON_PARAMS = frozenset((*MUON_KEYS, *ADAM_KEYS, "muon_lr", "adam_lr", "adam_w_mode", "torch_adam"))

# DeepSpeed's compressed-communication optimizers (zerospeed/optim/onebit), bound to the engine
# after it is built (Note [the engine's backward all-reduce] in onebit/base.py).
_ONE_BIT = {"onebitadam": "OnebitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OnebitLamb"}

_ADAM_EXTRAS = ("torch_adam", "adam_w_mode", "bias_correction", "set_grad_none")
_LION_EXTRAS = ("set_grad_none",)


def build_optimizer(
    opt_type: str | None,
    opt_params: dict[str, Any] | None,
    model_parameters: Iterable[Any],
    client_optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    *,
    allow_untested: bool = True,
) -> torch.optim.Optimizer:
    """Return the basic (unwrapped) optimizer.

    Args:
        opt_type: ``optimizer.type`` from the config, or None.
        opt_params: ``optimizer.params`` from the config, or None.
        model_parameters: tensors, ``(name, tensor)`` pairs, or param-group dicts; frozen
            parameters and then-empty groups are dropped.
        client_optimizer: an Optimizer (returned as is) or a callable(params) -> Optimizer;
            takes precedence over ``opt_type``.
        allow_untested: when False (ZeRO without ``zero_allow_untested_optimizer``), refuse
            optimizers outside ``ZERO_TESTED_OPTIMIZERS``.
    """
    if isinstance(client_optimizer, torch.optim.Optimizer) or (client_optimizer is None and opt_type is None):
        # nothing to normalise: the client's own optimizer, or the error that names optimizer.type
        return optimizer_for_groups(opt_type, opt_params, [], client_optimizer, allow_untested=allow_untested)
    groups, was_flat = trainable_param_groups(model_parameters)
    if was_flat and client_optimizer is not None:  # a callable client gets what it was given: a flat list
        return _finish(_from_client(client_optimizer, groups[0]["params"]), opt_type, allow_untested)
    return optimizer_for_groups(opt_type, opt_params, groups, client_optimizer, allow_untested=allow_untested)


def optimizer_for_groups(
    opt_type: str | None,
    opt_params: dict[str, Any] | None,
    groups: list[dict[str, Any]],
    client_optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    *,
    allow_untested: bool = True,
) -> torch.optim.Optimizer:
    """`build_optimizer` over param groups already normalised (`optim.param_groups.trainable_param_groups`:
    what the engine hands over, once); a callable client optimizer receives the groups."""
    if client_optimizer is not None:
        return _finish(_from_client(client_optimizer, groups), opt_type, allow_untested)
    if opt_type is None:
        raise ConfigError(
            "optimizer.type: no optimizer configured and no client optimizer passed; set "
            'optimizer.type (e.g. "AdamW") or pass optimizer= to initialize()'
        )
    return _finish(_from_config(opt_type, dict(opt_params or {}), groups), None, allow_untested)


def _finish(optimizer: torch.optim.Optimizer, ignored_type: str | None, allow_untested: bool) -> torch.optim.Optimizer:
    if ignored_type is not None:
        logger.warning("client optimizer given: ignoring optimizer.type %r from the config", ignored_type)
    # Empty groups carry nothing but state and break flattening; DeepSpeed drops them too.
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if len(g["params"]) != 0]
    if not allow_untested:
        _check_zero_tested(optimizer)
    logger.info("basic optimizer: %s", type(optimizer).__name__)
    return optimizer


def is_zero_tested_optimizer(optimizer: Any) -> bool:
    """True when ZeRO may shard this optimizer's state without ``zero_allow_untested_optimizer``."""
    return type(optimizer) in ZERO_TESTED_OPTIMIZERS


def _check_zero_tested(optimizer: Any) -> None:
    if is_zero_tested_optimizer(optimizer) or hasattr(optimizer, "bind_engine"):
        return  # (the 1-bit optimizers refuse sharded states themselves, with the reason, when bound)
    tested = [c.__name__ for c in ZERO_TESTED_OPTIMIZERS]
    why = " (its per-tensor trust ratio is wrong on ZeRO shards)" if isinstance(optimizer, Lamb) else ""
    raise ConfigError(
        f"zero_allow_untested_optimizer: {type(optimizer).__name__} is not tested with ZeRO{why}; "
        f'tested: {tested}. Set "zero_allow_untested_optimizer": true to use it anyway.'
    )


def _from_client(client: Any, params: list) -> torch.optim.Optimizer:
    """The client's optimizer: itself, or what the callable builds over `params` (normalised groups, or
    the flat list of trainable tensors a caller gave)."""
    if isinstance(client, torch.optim.Optimizer):
        return client
    if not callable(client):
        raise ConfigError(
            f"optimizer: the client optimizer must be a torch.optim.Optimizer or a "
            f"callable(params) -> Optimizer, got {type(client).__name__}"
        )
    optimizer = client(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer: the client callable returned {type(optimizer).__name__}, expected a torch.optim.Optimizer"
        )
    return optimizer


def _from_config(opt_type: str, params: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if "max_grad_norm" in params and opt_type.lower() not in _ONE_BIT:  # (1-bit ones take it, and refuse non-zero)
        raise ConfigError("optimizer.params.max_grad_norm: not supported; use the top-level gradient_clipping")
    if opt_type.lower() == "muon":
        return _muon(params, groups)
    cls, params, extras = _resolve(opt_type, params)
    check_params(params, cls, "optimizer.params", extra_accepted=extras)
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])  # JSON has no tuples; keep state_dicts uniform
    try:
        return cls(groups, **params)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optimizer.params: {cls.__name__} rejected {params}: {err}") from err


def _resolve(opt_type: str, params: dict[str, Any]) -> tuple[type, dict[str, Any], tuple[str, ...]]:
    """Map a config name to (class, params for it, DeepSpeed-only keys consumed)."""
    if not isinstance(opt_type, str):
        raise ConfigError(f"optimizer.type: must be a string, got {type(opt_type).__name__}")
    key = opt_type.lower()
    if key in _NOT_IMPLEMENTED:
        raise ConfigError(
            f"optimizer.type: {opt_type!r} ({_NOT_IMPLEMENTED[key]}) is not implemented yet; "
            "use Adam, AdamW, Lamb, Lion, SGD or Adagrad"
        )
    if key in ("adam", "adamw"):
        return (*_adam_params(params, force_decoupled=key == "adamw"), _ADAM_EXTRAS)
    if key in _ONE_BIT:
        if isinstance(params.get("betas"), list):
            params["betas"] = tuple(params["betas"])
        return getattr(onebit, _ONE_BIT[key]), params, ()
    if key == "lion":
        params.pop("set_grad_none", None)
        # DeepSpeed's FusedLion defaults, not the paper's (our Lion class has the paper's).
        params.setdefault("lr", 1e-3)
        params.setdefault("betas", (0.9, 0.999))
        return Lion, params, _LION_EXTRAS
    builtin = {"lamb": Lamb, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}.get(key)
    if builtin is not None:
        return builtin, params, ()
    return _torch_optimizer_class(opt_type), params, ()


def _muon(params: dict[str, Any], groups: list[dict[str, Any]]) -> MuonWithAuxAdam:
    """DeepSpeed's Muon: `initialize` already split the groups into halves (`use_muon` set); a direct
    caller's groups are split here by the parameters' own `use_muon` attributes."""
    if "per_head_muon" in params:
        raise ConfigError("optimizer.params.per_head_muon: per-head Muon is not implemented yet; remove the key")
    unknown = sorted(set(params) - _MUON_PARAMS)
    if unknown:
        hint = closest_names(unknown[0], sorted(_MUON_PARAMS))
        raise ConfigError(
            f"optimizer.params: Muon does not take {unknown}"
            + (f" (did you mean {hint}?)" if hint else "")
            + f"; it takes {sorted(_MUON_PARAMS)}"
        )
    if params.get("ns_method", "gram") not in NS_METHODS:
        raise ConfigError(f"optimizer.params.ns_method: must be one of {list(NS_METHODS)}, got {params['ns_method']!r}")
    if not all("use_muon" in g for g in groups):
        untagged = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
        if untagged:
            raise ConfigError(
                f"optimizer.type: Muon needs every parameter tagged with use_muon and {len(untagged)} are not; "
                "set `param.use_muon = True / False`, or let initialize() tag the model's parameters"
            )
        groups = muon_param_groups(groups, {id(p): bool(p.use_muon) for g in groups for p in g["params"]}, params)
    for g in groups:
        if g["use_muon"] and g.get("ns_method", "gram") not in NS_METHODS:
            raise ConfigError(f"optimizer: a Muon group's ns_method must be one of {list(NS_METHODS)}")
    return MuonWithAuxAdam(groups, adam_w_mode=bool(params.get("adam_w_mode", True)))


def _adam_params(params: dict[str, Any], force_decoupled: bool) -> tuple[type, dict[str, Any]]:
    torch_adam = params.pop("torch_adam", False)
    params.pop("set_grad_none", None)
    adam_w_mode = params.pop("adam_w_mode", True)
    if not params.pop("bias_correction", True):
        raise ConfigError(
            "optimizer.params.bias_correction: false is not supported; torch Adam/AdamW always bias-correct"
        )
    if not torch_adam:
        # DeepSpeed builds FusedAdam (weight_decay 0) unless torch_adam asks for torch's class
        # with torch's defaults (AdamW: 0.01).
        params.setdefault("weight_decay", 0.0)
    cls = torch.optim.AdamW if (force_decoupled or adam_w_mode) else torch.optim.Adam
    return cls, params


def _torch_optimizer_class(name: str) -> type:
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
        return cls
    known = ["Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad", *_torch_optimizer_names()]
    hint = closest_names(name, known)
    raise ConfigError(
        f"optimizer.type: unknown optimizer {name!r}"
        + (f"; did you mean {hint}?" if hint else "")
        + " Known: DeepSpeed's Adam, AdamW, Lamb, Lion, Adagrad (any case) or a torch.optim class by exact name."
    )


def _torch_optimizer_names() -> list[str]:
    return sorted(
        n
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    )
