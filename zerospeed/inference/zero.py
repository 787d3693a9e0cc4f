"""ZeRO-Inference: serve a model through the stage-3 engine, its weights sharded over the data-parallel
ranks and (with `zero.offload_param`) kept in CPU or NVMe memory, gathered one module at a time.

The training engine's stage 3 already does what inference needs: its forward hooks gather a module's
parameters before it runs and release them after, and its fetch schedule prefetches the next modules
in the order the previous forward used them (Note [stage-3 prefetch order]). Generation calls the
model's forward once per token with the same module order every time, so the engine here marks each
forward as a new "micro-step" (a pre-hook on the root module, run before any other hook): step t+1
prefetches by step t's recorded order, so the next layer's weights move while this one computes.
No optimizer is built. ZeRO-Inference and tensor parallelism together are refused.
"""
from __future__ import annotations

import torch
from torch import nn

from zerospeed.config.errors import ConfigError
from zerospeed.inference.config import DeepSpeedInferenceConfig

_PRECISION = {torch.float16: {"fp16": {"enabled": True}}, torch.bfloat16: {"bf16": {"enabled": True}},
              torch.float32: {}}


def zero_inference_engine(model: nn.Module, config: DeepSpeedInferenceConfig):
    """A stage-3 `Engine` over `model` (parameters sharded / offloaded as `config.zero` says)."""
    import zerospeed
    if config.tensor_parallel.tp_size > 1:
        raise ConfigError("zero.stage: 3 with tensor_parallel.tp_size > 1: ZeRO-Inference and tensor-parallel "
                          "inference together are not implemented; use one of them")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": config.zero.model_dump(exclude_unset=True),
                 **_PRECISION[config.dtype]}
    engine, *_ = zerospeed.initialize(model=model, config=ds_config)
    engine.zero.residency.spare = {}  # Note [reused full buffers]: generation runs without gradients
    model.register_forward_pre_hook(lambda module, args: engine.zero.start_micro_step(), prepend=True)
    return engine
