"""Models that never exist whole on one rank: build under `zero.Init`, load saved weights shard-wise.

`with zerospeed.zero.Init(config_dict_or_path=cfg): model = AutoModelForCausalLM.from_config(c)`
works as is. transformers' `from_pretrained` does not: it switches to DeepSpeed's own `zero.Init`
only when its global DeepSpeed config says stage 3 (`is_deepspeed_zero3_enabled()`), and then
imports `deepspeed` and loads through `deepspeed.zero.GatheredParameters`; otherwise it builds the
model on the meta device, which our `zero.Init` cannot shard. Making it take our Init would mean
patching transformers (DESIGN principle 3 says no), so `from_pretrained_zero3` does the same job
in the open: build from the saved config under our `Init`, then copy the saved weights in one
module at a time, each gathered only while it is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from zerospeed.zero import GatheredParameters, Init, tags

logger = logging.getLogger(__name__)

__all__ = ["from_pretrained_zero3", "is_zero3_sharded", "load_weights_zero3", "read_saved_weights", "zero3_numel"]


def _owners(model: torch.nn.Module) -> dict[int, Any]:
    return {id(o): o for p in model.parameters() if (o := tags.owner_of(p)) is not None}


def is_zero3_sharded(model: torch.nn.Module) -> bool:
    """True when some parameter of `model` is owned by a stage-3 flat parameter (`zero.Init`)."""
    return bool(_owners(model))


def zero3_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(full parameter count, elements this rank holds): the shards of sharded parameters plus every
    ordinary parameter. Tied parameters count once."""
    full = local = 0
    for p in model.parameters():  # deduplicated by nn.Module
        if tags.owner_of(p) is None:
            full += p.numel()
            local += p.numel()
        else:
            full += tags.full_numel(p)
    local += sum(o.layout.chunk for o in _owners(model).values())
    return full, local


def read_saved_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a `save_pretrained` dir: `model.safetensors`, its sharded index, or
    `pytorch_model.bin`."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(str(d / name)))
        return out
    if (d / "pytorch_model.bin").is_file():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
        "pass a directory written by save_pretrained / Trainer.save_model"
    )


@torch.no_grad()
def load_weights_zero3(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Collective: copy `state_dict` into a (possibly `zero.Init`-sharded) model, module by module.

    Each module's sharded parameters are gathered only while their values are written, then
    re-sharded, so the model is never whole. Every rank passes the same `state_dict`.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters: their first name
    missing = [n for n in names.values() if n not in state_dict]
    if strict and missing:
        raise KeyError(
            f"load_weights_zero3: the saved weights lack {missing}; pass strict=False to keep "
            "those parameters as initialised"
        )
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if names.get(id(p)) in state_dict]
        if not own:
            continue
        with GatheredParameters(own, modifier_rank=0):
            for p in own:
                p.data.copy_(state_dict[names[id(p)]].to(p.dtype).view(p.shape))
        for p in own:
            names.pop(id(p))  # a tied parameter is written once
    for name, buf in model.named_buffers():
        if name in state_dict:
            buf.copy_(state_dict[name])


def from_pretrained_zero3(
    model_cls: Any, model_dir: str | Path, config_dict_or_path: Any = None, strict: bool = True, **config_kwargs: Any
) -> torch.nn.Module:
    """`model_cls.from_pretrained(model_dir)` for ZeRO stage 3: built under `zero.Init` (each rank
    holds 1/N of the parameters from the start) and loaded from the local dir without a full copy.

    `model_cls` is an `AutoModelFor...` class or a concrete `PreTrainedModel` class;
    `config_dict_or_path` is the zerospeed config (for the dtype, as in `zero.Init`). Nothing is
    downloaded: `model_dir` must be a local `save_pretrained` directory.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True, **config_kwargs)
    build = getattr(model_cls, "from_config", None) or model_cls._from_config
    with Init(config_dict_or_path=config_dict_or_path):
        model = build(config)
    load_weights_zero3(model, read_saved_weights(model_dir), strict=strict)
    return model
