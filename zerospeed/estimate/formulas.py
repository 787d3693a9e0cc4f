"""Pure memory formulas of the estimator: model states for every ZeRO stage x offload, activations.

Per-device bytes for stages 0-3 come from `zerospeed.zero.memory.model_state_bytes` (the formula
the engine itself reports; stage 3 is the ZeRO paper's (2 + 2 + K)/N). Offload moves state from the
device to the host (see `placed_model_states`).
`deepspeed_zero2_bytes` / `deepspeed_zero3_bytes` reproduce the rules behind DeepSpeed's documented
`estimate_zero{2,3}_model_states_mem_needs` tables (1.5x buffer factor on host memory), so their
numbers can be compared one to one. No function here touches torch or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerospeed.estimate.layout import stage_activation_bytes
from zerospeed.zero.memory import OPTIMIZER_STATE_BYTES, model_state_bytes

# DeepSpeed's estimator multiplies host memory by this factor for pinned / staging buffers.
HOST_BUFFER_FACTOR = 1.5
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model-state component."""

    param: int
    grad: int
    master: int
    optim: int

    @classmethod
    def of(cls, dtype: str = "fp16", optimizer: str = "adam", grad_dtype: str | None = None) -> Precision:
        """`dtype` of the model (fp32/fp16/bf16), optimizer name, gradient dtype (default: the model's)."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"precision must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
        grad = DTYPE_BYTES[grad_dtype or dtype]
        return cls(DTYPE_BYTES[dtype], grad, 4 if dtype != "fp32" else 0, OPTIMIZER_STATE_BYTES[optimizer])


def stage_bytes(num_params: int, world_size: int, stage: int, prec: Precision) -> dict[str, float]:
    """Per-device bytes of parameters, gradients, masters and optimizer states at ZeRO `stage` 0-3."""
    return model_state_bytes(
        num_params,
        world_size,
        stage,
        param_bytes=prec.param,
        grad_bytes=prec.grad,
        master_bytes=prec.master,
        optim_bytes=prec.optim,
    )


@dataclass(frozen=True)
class Option:
    """One ZeRO configuration: stage, optimizer offload to the host, parameter offload to the host."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False

    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload_optimizer:
            parts.append("offload_optimizer=cpu")
        if self.offload_param:
            parts.append("offload_param=cpu")
        return ", ".join(parts)


# Every option, fastest first: stages 0-2 move the same bytes per step (the paper's result), stage 3
# adds 50% traffic, and host offload adds PCIe transfers plus a CPU optimizer step.
OPTIONS = (
    Option(0),
    Option(1),
    Option(2),
    Option(3),
    Option(1, True),
    Option(2, True),
    Option(3, True),
    Option(3, True, True),
)


def placed_model_states(
    num_params: int, world_size: int, option: Option, prec: Precision, largest_layer_params: int = 0
) -> dict[str, dict[str, float]]:
    """Per-rank model-state bytes split into {"device": {...}, "host": {...}} for `option`.

    Optimizer offload (ZeRO-Offload) keeps the rank's shard of fp32 masters, optimizer states and its
    fp32 gradient partition on the host. At stages 2 and 3 gradients are reduced straight into that
    host partition (the device holds only the in-flight reduce buckets, a term of the peak, not a model
    state), as in DeepSpeed's own estimator; at stage 1 the device keeps its whole gradient buffer until
    the step reduces it. Parameter offload (stage 3) moves the parameter shard to the host too; the
    device then holds only the largest layer's gathered parameters while it runs. Measured on one H200
    (2.65 B GPT, stage 3, optimizer and parameters offloaded, docs/benchmarks.md): 12.5 GB device
    peak, what the activations and logits alone take — before, the device's gradient partition (10.6 GB
    here) was counted too.
    """
    if option.offload_param and (option.stage != 3 or not option.offload_optimizer):
        raise ValueError("offload_param needs stage 3 with offload_optimizer (as in DeepSpeed's estimator)")
    if option.offload_optimizer and option.stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    dev = stage_bytes(num_params, world_size, option.stage, prec)
    host = {"parameters": 0.0, "gradients": 0.0, "master_weights": 0.0, "optimizer_states": 0.0}
    if option.offload_optimizer:
        # On the host the step runs in fp32 on the rank's 1/N shard, even for fp32 models.
        host["master_weights"] = num_params * 4 / world_size
        host["optimizer_states"] = dev["optimizer_states"]
        host["gradients"] = num_params * 4 / world_size
        dev["master_weights"] = dev["optimizer_states"] = 0.0
        if option.stage >= 2:
            dev["gradients"] = 0.0
    if option.offload_param:
        host["parameters"] = dev["parameters"]
        dev["parameters"] = float(largest_layer_params * prec.param)
    return {"device": dev, "host": host}


def transformer_activation_bytes(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool,
    act_bytes: int = 2,
    tp: int = 1,
    sequence_parallel: bool = False,
    micro_batches_in_flight: int = 1,
    attention: str = "sdpa",
) -> float:
    """Activation memory of one rank's micro-batch(es) through `layers` GPT-style layers.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count
    s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations, s*b*h*(10 + 24/t + 5*a*s/(h*t)) at
    tensor-parallel size t, and all of it / t with sequence parallelism (`layout.layer_activation_bytes`);
    the 5*a*s/h term (the attention scores) only with `attention="eager"`: fused attention keeps none.
    With full activation checkpointing each layer keeps only its 16-bit input (2*s*b*h) and one layer's
    activations are live again while it is recomputed. `act_bytes` 4 doubles everything (fp32
    activations); a pipeline stage multiplies by the micro-batches it holds (`layout.in_flight`).
    """
    return stage_activation_bytes(
        layers=layers,
        seq_len=seq_len,
        micro_batch=micro_batch,
        hidden=hidden,
        heads=heads,
        checkpointing=checkpointing,
        tp=tp,
        sequence_parallel=sequence_parallel,
        micro_batches_in_flight=micro_batches_in_flight,
        act_bytes=act_bytes,
        attention=attention,
    )


def deepspeed_zero2_bytes(
    total_params: int, num_gpus_per_node: int, num_nodes: int, cpu_offload: bool
) -> tuple[float, float]:
    """(host, device) bytes by the rule of DeepSpeed's ZeRO-2 estimator (mixed-precision Adam)."""
    total_gpus = num_gpus_per_node * num_nodes
    if cpu_offload:
        return total_params * max(4 * total_gpus, 16) * HOST_BUFFER_FACTOR, 2.0 * total_params
    # Host: every local rank holds an fp32 copy of the model while it is loaded ("all cold" start).
    return (
        total_params * 4 * num_gpus_per_node * HOST_BUFFER_FACTOR,
        4 * total_params + int(16 * total_params / total_gpus),
    )


def deepspeed_zero3_bytes(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int,
    num_nodes: int,
    offload_optimizer: bool,
    offload_param: bool,
    zero_init: bool,
) -> tuple[float, float]:
    """(host, device) bytes by the rule of DeepSpeed's ZeRO-3 estimator (mixed-precision Adam).

    The device always needs the largest layer gathered in fp32-sized room (4 bytes/param). With
    zero_init the model is built already partitioned, so host memory is per node, not per rank.
    """
    total_gpus = num_gpus_per_node * num_nodes
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if offload_optimizer and offload_param:
        host_per_param = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        return total_params * host_per_param * HOST_BUFFER_FACTOR, float(largest)
    if offload_optimizer:
        host_per_param = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        return total_params * host_per_param * HOST_BUFFER_FACTOR, largest + int(2 * total_params / total_gpus)
    host = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * HOST_BUFFER_FACTOR
    return host, largest + int(18 * total_params / total_gpus)
