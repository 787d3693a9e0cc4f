"""`InferenceEngine`: DeepSpeed's inference wrapper, at `deepspeed.inference.engine.InferenceEngine`.

It sequences, once, at construction: refuse what is not implemented (naming the key) -> load the
checkpoint into the whole model and shard it over the tp group with AutoTP (full logits, one seed:
tp.py) — or, for a model built on the meta device, shard first and read only this rank's slices
(shard_load.py) -> quantize linear weights to int8 / int4 (weight-only, each rank its own slice: quantize/) -> convert
to `dtype` -> move to the device (unless `keep_module_on_host`), or hand the model to a ZeRO stage-3
engine (ZeRO-Inference: zero.py). After that, `engine(...)` is the model's forward and
`engine.generate(...)` the model's own `generate` — the transformers generation loop, with its KV
cache (which holds this rank's heads under TP) and every sampling option meaning what it means there.

`replace_with_kernel_inject` is accepted: there are no fused inference kernels in zerospeed, so it
changes nothing (the model keeps its PyTorch forward; with tp_size > 1, AutoTP still shards it). The
engine says so once in the log rather than failing a DeepSpeed script that sets it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zerospeed.accelerator import get_accelerator
from zerospeed.compression.weight_quant import quantize_model, settings_from_config
from zerospeed.inference import tp as tp_mod
from zerospeed.inference.checkpoint import checkpoint_files, load_checkpoint
from zerospeed.inference.config import DeepSpeedInferenceConfig
from zerospeed.inference.shard_load import is_meta_model, load_shards
from zerospeed.inference.zero import zero_inference_engine
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import log_dist


class InferenceEngine(nn.Module):
    """A model prepared for inference; `module` is the (sharded) model itself."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig):
        super().__init__()
        problems = config.unsupported()
        if problems:
            raise ConfigError("init_inference: " + "; ".join(problems))
        self._config = config
        self.module = model
        self.mp_group, self.tp_size = tp_mod.resolve_group(config)
        self.shard_report = None
        self.zero_engine = None
        if config.replace_with_kernel_inject:
            log_dist(
                "init_inference: replace_with_kernel_inject has no effect in zerospeed (no fused kernels); "
                "the model runs its own forward" + (", sharded by AutoTP" if self.tp_size > 1 else ""),
                ranks=[0],
                level=logging.INFO,
            )
        self._load_and_shard(model, config)
        self.quantized: dict[str, int] = {}
        if config.weight_quantization() and config.zero.stage != 3:  # (ZeRO-Inference: its shards, zero.py)
            try:
                self.quantized = quantize_model(model, settings_from_config(config.quant.weight))
            except ValueError as exc:
                raise ConfigError(f"quant.weight: {exc}") from None
        if config.zero.stage == 3:
            self.zero_engine, self.quantized = zero_inference_engine(model, config)
        else:
            model.to(config.dtype)
            if not config.keep_module_on_host:
                model.to(get_accelerator().current_device_name())
        model.eval()

    def _load_and_shard(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        if is_meta_model(model):  # shard-on-load: only this rank's slices are ever read (shard_load.py)
            if config.checkpoint is None:
                raise ConfigError(
                    "init_inference: the model is on the meta device; give `checkpoint` (safetensors "
                    "files) to load its weights from"
                )
            self._shard(model, config)
            load_shards(model, checkpoint_files(config.checkpoint, config.base_dir))
            return
        if config.checkpoint is not None:
            load_checkpoint(model, config.checkpoint, config.base_dir)
        self._shard(model, config)

    def _shard(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        if self.tp_size > 1 or config.injection_policy:
            self.shard_report = tp_mod.shard_for_inference(model, self.mp_group, config)
            tp_mod.share_seed(self.mp_group)

    @property
    def config(self):
        """The served model's own config (what transformers pipelines read), else the inference config."""
        return getattr(self.module, "config", self._config)

    def forward(self, *inputs, **kwargs):
        with torch.no_grad():  # not inference_mode: ZeRO-3 gathers into tensors autograd versions
            return self.module(*inputs, **kwargs)

    def generate(self, *inputs, **kwargs):
        """The model's `generate` (transformers' loop, KV cache on); prompts longer than max_out_tokens
        are refused, as in DeepSpeed."""
        ids = kwargs.get("input_ids", inputs[0] if inputs else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] > self._config.max_out_tokens:
            raise ConfigError(
                f"generate: the prompt has {ids.shape[-1]} tokens but max_out_tokens is "
                f"{self._config.max_out_tokens}; raise max_out_tokens (alias max_tokens) in the "
                "inference config"
            )
        if not hasattr(self.module, "generate"):
            raise TypeError(f"{type(self.module).__name__} has no generate(); call the engine as the model instead")
        with torch.no_grad():  # not inference_mode: ZeRO-3 gathers into tensors autograd versions
            return self.module.generate(*inputs, **kwargs)
