"""AutoTP from the config: `"tensor_parallel": {"autotp_size": N, ...}` makes `initialize` shard the model.

As in DeepSpeed (since 0.16.4), `initialize` applies AutoTP itself when the config asks for it, so the
training loop does not change; a model already sharded (`tp_model_init`) is left as it is. The mesh's
tensor axis has N ranks (adjacent ranks), data parallelism fills the rest. Sharding replaces modules,
and with them their parameters, so the `model_parameters` the user passed (taken before sharding) are
mapped to the sharded model's parameters by name (`utils.param_groups.substitute_parameters`); a client optimizer
built over the unsharded
parameters cannot be mapped and is refused.
"""

from __future__ import annotations

import torch

from zerospeed.config import ConfigError
from zerospeed.optim.param_groups import substitute_parameters
from zerospeed.parallel.tensor.autotp import shard_model
from zerospeed.parallel.tensor.layers import TensorParallelModule


def tensor_parallel_size(raw: dict) -> int:
    """The config's tensor-parallel degree (autotp_size; 0 and absent mean 1)."""
    value = (raw.get("tensor_parallel") or {}).get("autotp_size", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"tensor_parallel.autotp_size must be a non-negative integer, got {value!r}")
    return max(1, value)


def _refuse_unsupported(tp_cfg) -> None:
    if tp_cfg.kernel_inject:
        raise ConfigError(
            "tensor_parallel.kernel_inject=true: zerospeed has no inference kernels to inject; "
            "remove the key (AutoTP training shards the model's own modules)"
        )


def _refuse_meta_model(model: torch.nn.Module, tp: int) -> None:
    """A model on the meta device has no weights to train: shard-on-load is tp_model_init's `checkpoint`."""
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is None:
        return
    fix = (
        f"zerospeed.tp_model_init(model, {tp}, checkpoint=<save_pretrained directory>) before initialize, "
        "which reads only this rank's slices"
        if tp > 1
        else "build it on the CPU, or, for tensor parallelism, "
        "call zerospeed.tp_model_init(model, N, checkpoint=<save_pretrained directory>) and set "
        "tensor_parallel.autotp_size N"
    )
    raise ConfigError(
        f"initialize: the model is on the meta device (parameter {meta!r} has no storage), so there "
        f"is nothing to train; load its weights first: {fix}"
    )


def apply_autotp_config(model: torch.nn.Module, mesh, cfg, optimizer, model_parameters):
    """Shard `model` over the mesh's tensor axis when the config asks (returns the remapped
    `model_parameters`); a no-op without tensor parallelism or for an already sharded model."""
    _refuse_meta_model(model, cfg.tensor_parallel.autotp_size)
    sharded = [m for m in model.modules() if isinstance(m, TensorParallelModule)]
    if cfg.tensor_parallel.autotp_size == 0 and not sharded:
        return model_parameters  # no AutoTP asked for (an mpu's own tensor parallelism is the model's business)
    if mesh.size("tp") == 1:
        if sharded and sharded[0].tp_size > 1:  # (layers over a tp group of one rank are plain layers)
            raise ConfigError(
                f"the model is already sharded for tensor parallelism over {sharded[0].tp_size} ranks "
                "(tp_model_init / shard_model) but the config has no tensor_parallel.autotp_size; add "
                f'"tensor_parallel": {{"autotp_size": {sharded[0].tp_size}}} so that the engine reduces '
                "gradients over the data-parallel ranks only"
            )
        return model_parameters
    if sharded:
        return model_parameters  # sharded already (tp_model_init / shard_model)
    tp_cfg = cfg.tensor_parallel
    _refuse_unsupported(tp_cfg)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "tensor_parallel: a client optimizer was built over the unsharded parameters, which AutoTP "
            "replaces; give the optimizer in the config, or pass a callable optimizer(params), or call "
            "zerospeed.tp_model_init(model, tp_size) before building the optimizer"
        )
    old_names = {id(p): n for n, p in model.named_parameters()}
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator (model.parameters()) must yield the old ones
        given = [p for item in model_parameters for p in (item["params"] if isinstance(item, dict) else [item])]
        if any(id(p) not in old_names for p in given):
            raise ConfigError(
                "tensor_parallel: a parameter in model_parameters is not one of the model's; pass "
                "model.parameters() or param groups of it"
            )
    shard_model(model, mesh.group("tp"), partition_config=tp_cfg.partition_config, preset_model=tp_cfg.preset_model)
    new = dict(model.named_parameters())
    return substitute_parameters(model_parameters, {i: new[n] for i, n in old_names.items() if n in new})
