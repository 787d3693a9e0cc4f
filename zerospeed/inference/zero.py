"""ZeRO-Inference: serve a model through the stage-3 engine, its weights sharded over the data-parallel
ranks and (with `zero.offload_param`) kept in CPU or NVMe memory, gathered one module at a time.

The training engine's stage 3 already does what inference needs: its forward hooks gather a module's
parameters before it runs and release them after, and its fetch schedule prefetches the next modules
in the order the previous forward used them (Note [stage-3 prefetch order]). Generation calls the
model's forward once per token with the same module order every time, so the engine here marks each
forward as a new "micro-step" (a pre-hook on the root module, run before any other hook): step t+1
prefetches by step t's recorded order, so the next layer's weights move while this one computes.
No optimizer is built, and the model is frozen first (requires_grad False): stage 3 then partitions
its parameters as frozen units (Note [partitioned frozen parameters]), which keep only the shard —
no fp32 master, no gradient chunk (they would be 4 + 4 bytes per element of each shard, and with
`offload_param` the master was kept on the device). ZeRO-Inference and tensor parallelism together
are refused.

Note [quantized ZeRO-Inference shards]: with `quant.weight` (`quantized_initialization` for every
linear layer, `post_init_quant` by layer-name substring: num_bits 8 or 4, group_size, symmetric),
each selected linear layer's stored shard — weight and bias, one flat chunk per rank — is
block-quantized once, `group_size` consecutive elements per scale (and minimum: DeepSpeed's default
is asymmetric), in `ops.quantizer`'s format (FlatParam.store_quantized). Host or device memory for
those layers drops to about 1/2 (int8) or 1/4 (int4) of fp16's, and every gather moves the stored
bytes, so the per-token transfer shrinks alike; the forward computes with the dequantized weights.
Groups follow the flat chunk, not the weight's rows (a group may span two rows when a row is not a
multiple of group_size). With NVMe offload the swap file holds the stored bytes, read as they are
(offload/param_swap.py). The tied output head is the embedding's unit, and the embedding is not a
linear layer: it stays unquantized, as without ZeRO.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.compression.weight_quant.layer import settings_from_config, stage3_settings
from zerospeed.inference.config import DeepSpeedInferenceConfig
from zerospeed.runtime.initialize import initialize
from zerospeed.utils.errors import ConfigError

_PRECISION = {
    torch.float16: {"fp16": {"enabled": True}},
    torch.bfloat16: {"bf16": {"enabled": True}},
    torch.float32: {},
}


def zero_inference_engine(model: nn.Module, config: DeepSpeedInferenceConfig):
    """A stage-3 `Engine` over `model` (parameters sharded / offloaded as `config.zero` says) and the
    {layer name: bits} of the layers whose shards are stored quantized."""
    if config.tensor_parallel.tp_size > 1:
        raise ConfigError(
            "zero.stage: 3 with tensor_parallel.tp_size > 1: ZeRO-Inference and tensor-parallel "
            "inference together are not implemented; use one of them"
        )
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": config.zero.model_dump(exclude_unset=True),
        **_PRECISION[config.dtype],
    }
    model.requires_grad_(False)  # frozen units: the shard only
    engine, *_ = initialize(model=model, config=ds_config)
    quantized = {}
    if config.weight_quantization():  # Note [quantized ZeRO-Inference shards]
        try:
            done = engine.zero.quantize_frozen(stage3_settings(settings_from_config(config.quant.weight)))
        except ValueError as exc:
            raise ConfigError(f"quant.weight: {exc}") from None
        quantized = {name: s[0] for name, s in done.items()}
    engine.zero.residency.spare = {}  # Note [reused full buffers]: generation runs without gradients
    model.register_forward_pre_hook(lambda module, args: engine.zero.start_micro_step(), prepend=True)
    return engine, quantized
