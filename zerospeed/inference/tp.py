"""Tensor-parallel inference: the tp group, AutoTP sharding, full logits, one random stream.

Note [full logits at inference]: AutoTP leaves the output head vocabulary-parallel, so `.logits` is
this rank's slice of the vocabulary (right for training, where the vocab-parallel loss never needs
the full logits). Generation needs every token's score, so the engine turns the head's
`gather_output` on: one all-gather of the last position's [B, 1, V/tp] per decoding step (transformers
asks the head for the last position only). The training loss AutoTP installed expects local logits,
so the model's own loss function is put back.

Note [tp sampling]: every tp rank runs the same generation loop on the same gathered logits; sampling
must draw the same token on every rank or the ranks' caches diverge. The engine gives the tp ranks one
seed (rank 0's) at start-up, as DeepSpeed broadcasts its RNG state.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zerospeed import comm
from zerospeed.inference.config import DeepSpeedInferenceConfig
from zerospeed.inference.injection import policy_partition_config, unmatched_policy_names
from zerospeed.parallel.tensor import shard_model
from zerospeed.parallel.tensor.autotp import is_linear_layer, text_config_of, tp_plans_of
from zerospeed.parallel.tensor.plan import resolve_rules
from zerospeed.utils.errors import ConfigError


def resolve_group(config: DeepSpeedInferenceConfig):
    """(tp group, tp size): the given tp_group, the mpu's model-parallel group, or a mesh of tp_size."""
    tp = config.tensor_parallel
    group = tp.tp_group
    if group is None and tp.mpu is not None:
        group = tp.mpu.get_model_parallel_group()
    if group is not None:
        size = comm.get_world_size(group)
        if tp.tp_size not in (1, size):
            raise ConfigError(
                f"tensor_parallel.tp_size = {tp.tp_size} but the given tp group has {size} ranks; give one of them"
            )
        return group, size
    size = tp.tp_size if tp.enabled else 1
    if size == 1:
        return None, 1
    # DeepSpeed's InferenceEngine joins the process group itself: its inference tutorial launches a
    # script on N ranks that calls init_inference(tensor_parallel={"tp_size": N}) and never
    # init_distributed(). Without launcher variables this forms a one-process group, refused below.
    comm.init_distributed()
    if comm.get_world_size() % size:
        raise ConfigError(
            f"tensor_parallel.tp_size = {size} needs a multiple of {size} ranks, but this job has "
            f"{comm.get_world_size()}; launch with `zerospeed --num_gpus {size}` (or torchrun)"
        )
    return comm.ParallelMesh.build(tp=size).group("tp"), size


def _policy_layers(model: nn.Module, policy: dict) -> dict[str, tuple[str, ...]]:
    def matches(module, key):
        return type(module) is key if isinstance(key, type) else type(module).__name__ == key

    layers = {
        name: tuple(rows)
        for key, rows in policy.items()
        for name, module in model.named_modules()
        if matches(module, key)
    }
    if not layers:
        names = [getattr(k, "__name__", k) for k in policy]
        raise ConfigError(f"injection_policy: no module of the model is one of {names}")
    return layers


def injection_partition_config(model: nn.Module, policy: dict) -> dict:
    """DeepSpeed's injection_policy as a partition_config (injection.py)."""
    layers = _policy_layers(model, policy)
    missing = unmatched_policy_names([n for n, _ in model.named_modules()], layers)
    if missing:
        raise ConfigError(f"injection_policy: layer name(s) {missing} are not in the policy's modules")
    heads = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    linears = [n for n, m in model.named_modules() if is_linear_layer(m) and id(m) not in heads]
    defaults = resolve_rules(tp_plans=tp_plans_of(model), model_type=getattr(text_config_of(model), "model_type", None))
    return policy_partition_config(linears, layers, defaults)


def shard_for_inference(model: nn.Module, group, config: DeepSpeedInferenceConfig):
    """Shard `model` over `group` with AutoTP and make its logits full (Note [full logits at inference])."""
    partition_config = injection_partition_config(model, config.injection_policy) if config.injection_policy else None
    own_loss = _own_loss_function(model)
    report = shard_model(model, group, partition_config=partition_config)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "gather_output"):
        head.gather_output = True
        if own_loss is not None:
            model.loss_function = own_loss
    return report


def _own_loss_function(model: nn.Module):
    """The model's loss function before AutoTP replaces it. transformers' getter logs a warning when the
    config names no loss type (it then picks the causal-LM loss): quiet here, where nobody asked."""
    if not hasattr(type(model), "loss_function"):
        return None
    log = logging.getLogger("transformers.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return model.loss_function
    finally:
        log.setLevel(level)


def share_seed(group) -> None:
    """Note [tp sampling]: every rank of `group` continues from the same torch seed."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    comm.broadcast(seed, src=comm.global_rank(group, 0), group=group)
    torch.manual_seed(int(seed.item()))
