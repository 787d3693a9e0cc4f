"""Pure model-state memory formulas (bytes per rank) for the layouts zerospeed uses.

ZeRO's accounting: every parameter costs `param_bytes` (the model's copy), `grad_bytes` (its
gradient), `master_bytes` (an fp32 master copy when the model is in 16-bit) and `optim_bytes`
(optimizer states: Adam's two fp32 moments = 8). Stage 1 divides master + optimizer states by the
data-parallel size N, stage 2 the gradients too, stage 3 the parameters as well. With the ZeRO paper's
mixed-precision Adam
(2 + 2 + 12 bytes) that gives 16, 4 + 12/N and 2 + 14/N bytes per parameter.
"""

from __future__ import annotations

# Optimizer-state bytes per parameter, fp32 states (per element of the stepped tensor).
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "adagrad": 4, "lion": 4, "sgd": 0, "sgd_momentum": 4}


def model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    master_bytes: int,
    optim_bytes: int,
) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients, master weights and optimizer states."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    n = world_size
    shard_grads = stage >= 2
    shard_optim = stage >= 1
    return {
        "parameters": num_params * param_bytes / (n if stage >= 3 else 1),
        "gradients": num_params * grad_bytes / (n if shard_grads else 1),
        "master_weights": num_params * master_bytes / (n if shard_optim else 1),
        "optimizer_states": num_params * optim_bytes / (n if shard_optim else 1),
    }


def grouped_model_state_bytes(groups: list[tuple[int, int]], stage: int, **bytes_per_param: int) -> dict[str, float]:
    """`model_state_bytes` summed over param groups given as (parameters on this rank, ranks the group
    shards over): dense weights over the data-parallel ranks, an MoE layer's local experts
    (num_experts / ep of them) over their expert-data-parallel ranks."""
    total: dict[str, float] = {}
    for numel, world in groups:
        for kind, value in model_state_bytes(numel, world, stage, **bytes_per_param).items():
            total[kind] = total.get(kind, 0.0) + value
    return total


# Note [1-bit optimizer states]: in their compressed stage the 1-bit optimizers hold, per trainable
# element and in fp32, their moments (1-bit Adam: m, v; 0/1 Adam: m, v and the momentum accumulator of
# its local steps; 1-bit LAMB: m, v and the variance frozen at freeze_step), plus the two error-feedback
# buffers of the compressed all-reduce over N ranks: the worker error (the whole tensor) and the server
# error (this rank's 1/N of it); none at N = 1, where nothing is compressed. 1-bit Adam at ZeRO-1/2
# keeps v as this rank's chunk (1/N) but the whole momentum (docs/comm_compression.md). Padding of the
# compressed tensors to whole bytes per rank is not counted (under 8N elements per parameter).
ONEBIT_STATE_WORDS = {"onebitadam": 2, "zerooneadam": 3, "onebitlamb": 3}


def onebit_state_bytes(kind: str, numel: int, world: int, stage: int) -> float:
    """Note [1-bit optimizer states]: the compressed stage's state bytes on one of `world` ranks."""
    errors = 1 + 1 / world if world > 1 else 0.0
    words = 1 / world + 1 if stage >= 1 else ONEBIT_STATE_WORDS[kind]
    return 4 * numel * (words + errors)


def optimizer_kind(optimizer) -> str:
    """The OPTIMIZER_STATE_BYTES key for a torch optimizer instance."""
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return "sgd_momentum" if momentum else "sgd"
    return name if name in OPTIMIZER_STATE_BYTES else "adam"
