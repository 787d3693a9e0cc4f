"""DeepSpeed's AutoEP checkpoints at ZeRO 0: reading a tag DeepSpeed 0.19.8 saved from a transformers MoE model
under `"expert_parallel"` at ZeRO stage 0 (Note [DeepSpeed AutoEP ZeRO-0 checkpoints]).

Note [DeepSpeed AutoEP ZeRO-0 checkpoints]: the tag has the files of a native-MoE ZeRO-0 tag (Note [DeepSpeed MoE
checkpoints] in deepspeed_experts.py) under AutoEP's names:
- `mp_rank_00_model_states.pt`: `module` = the dense weights (the router under `mlp.router.gate.weight`, and again
  under the alias `mlp.gate.gate.weight`, a copy), no experts; `param_shapes` None; `ds_autoep_layers` with
  checkpoint_format `per_expert_files`;
- `layer_{l}_expert_{e}_mp_rank_00_model_states.pt`: global expert e's rows of the stacked experts,
  `{prefix}.w1.{e}` [I, H], `w2.{e}` [H, I], `w3.{e}` [I, H] (at ZeRO 0 the weights are the optimizer's own:
  with fp32 they are the masters);
- per ep rank e, `expp_rank_{e}_mp_rank_00_optim_states.pt` = {"optimizer": that rank's torch optimizer
  `state_dict()`}: group 0 "dense-params" (the dense parameters in module order, the alias counted once; every ep
  rank holds the same), group 1 (`moe: True`) per AutoEP layer its local `w1`, `w2`, `w3` [E/ep, ...] (GroupedExperts'
  order), states unflattened.
This module stacks the experts in global order (weights from the expert files, moments from the ep ranks' files
in ep order) and hands them to deepspeed_autoep.autoep_checkpoint (transformers' names), which loads into
zerospeed's AutoEP at any stage / ep. Every position's moment shape is checked against the weight it stands for.
Read: fp32 runs, one dense and one expert param group, one ep size; anything else is refused naming the tag.
Tested on the autoep_zero0_ep2 fixture (2 ranks, ep 2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_autoep import (
    autoep_checkpoint,
    autoep_ep_size,
    autoep_format,
    read_autoep_model,
)
from zerospeed.checkpoint.deepspeed_autoep_names import EXPERT_WEIGHTS as WEIGHTS
from zerospeed.checkpoint.deepspeed_import import MODEL, DeepSpeedCheckpoint, _load, _scalars, optim_prefix
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32

EXPP = "expp_rank_{}_mp_rank_00_optim_states.pt"
EXPERT_FILE = "layer_{}_expert_{}_mp_rank_00_model_states.pt"


def is_deepspeed_autoep_zero0_tag(tag_dir: Path) -> bool:
    """A ZeRO-0 tag DeepSpeed's AutoEP saved (model states with per-expert-file `ds_autoep_layers`, expp_rank_*
    optimizer files, no ZeRO partitions)."""
    tag_dir = Path(tag_dir)
    path = tag_dir / MODEL
    if not (tag_dir / EXPP.format(0)).exists() or optim_prefix(tag_dir) is not None:
        return False
    return autoep_format(path) == "per_expert_files"


def _dense_names(model: dict, layers: list[dict]) -> list[str]:
    """The dense trainable parameters in module order: `module` without buffers and without the router's aliases
    (`{path}.X.rest` where `{path}.router.rest` is saved too, X one name)."""
    module, buffers = model["module"], set(model.get("buffer_names") or [])
    aliases = set()
    for entry in layers:
        path = entry["module_path"] + "."
        for name in module:
            head, _, rest = name[len(path) :].partition(".")
            if name.startswith(path) and head != "router" and f"{path}router.{rest}" in module:
                aliases.add(name)
    return [n for n in module if n not in buffers and n not in aliases]


def read_deepspeed_autoep_zero0_checkpoint(
    tag_dir: Path, names: set[str] | None = None, group_names: list[list[str]] | None = None
) -> DeepSpeedCheckpoint:
    """The universal form (transformers' names, whole [E, ...] experts) of a DeepSpeed AutoEP ZeRO-0 tag."""
    del group_names  # (the module and the AutoEP layers name the parameters)
    tag_dir = Path(tag_dir)
    model, dp, ds_config = read_autoep_model(tag_dir, MODEL)
    for key in ("fp16", "bf16"):
        if isinstance(ds_config.get(key), dict) and ds_config[key].get("enabled"):
            raise CheckpointError(
                f"{tag_dir}: a {key} DeepSpeed AutoEP checkpoint at ZeRO 0 is not read here (its {EXPP.format(0)} "
                "holds DeepSpeed's mixed-precision wrapper, fp32_groups and optimizer_state_dict); only fp32 ZeRO-0 "
                "runs are (bf16 AutoEP tags at ZeRO 1-3 are read)"
            )
    layers = model["ds_autoep_layers"]
    ep = autoep_ep_size(tag_dir, model)
    optims = []
    for e in range(ep):
        path = tag_dir / EXPP.format(e)
        if not path.exists():
            raise CheckpointError(f"{tag_dir}: {path.name} is missing (the checkpoint was saved at ep {ep})")
        optims.append(_load(path)["optimizer"])
    groups = optims[0]["param_groups"]
    if [bool(g.get("moe")) for g in groups] != [False, True]:
        raise CheckpointError(
            f"{tag_dir}: {EXPP.format(0)} has param groups moe={[bool(g.get('moe')) for g in groups]}; only one "
            "dense and one expert group are read here"
        )
    module = model["module"]

    def states(optim: dict, gi: int, names_: list[str], shapes: list[tuple], file: str) -> list[dict]:
        keys = optim["param_groups"][gi]["params"]
        if len(keys) != len(names_):
            raise CheckpointError(
                f"{tag_dir}: {file} holds {len(keys)} parameters in param group {gi}, the tag's "
                f"{'experts' if gi else 'module'} {len(names_)}; is it a DeepSpeed AutoEP checkpoint of this model?"
            )
        out = []
        for key, name, shape in zip(keys, names_, shapes, strict=True):
            state = optim["state"].get(key, {})
            moments = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
            bad = {k: tuple(v.shape) for k, v in moments.items() if tuple(v.shape) != tuple(shape)}
            if bad:
                raise CheckpointError(f"{tag_dir}: {file}'s states {bad} for {name} do not fit its shape {shape}")
            out.append(state)
        return out

    dense = _dense_names(model, layers)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    dense_states = states(optims[0], 0, dense, [tuple(module[n].shape) for n in dense], EXPP.format(0))
    for name, state in zip(dense, dense_states, strict=True):
        tensors[name] = {
            FP32: module[name].float(),
            **{k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0},
        }
    local_names = [f"{entry['expert_key_prefix']}.{w}" for entry in layers for w in WEIGHTS]
    expert_states = []
    for li, entry in enumerate(layers):
        li = int(entry.get("moe_layer_id", li))  # (the expert files' layer number)
        count = int(entry["num_experts"])
        if count % ep:
            raise CheckpointError(f"{tag_dir}: ep size {ep} does not divide {entry['module_path']}'s {count} experts")
        files = []
        for e in range(count):
            path = tag_dir / EXPERT_FILE.format(li, e)
            if not path.exists():
                raise CheckpointError(f"{tag_dir}: {path.name} is missing ({entry['module_path']} has {count} experts)")
            files.append(_load(path))
        for w in WEIGHTS:
            key = f"{entry['expert_key_prefix']}.{w}"
            if any(f"{key}.{e}" not in files[e] for e in range(count)):
                raise CheckpointError(f"{tag_dir}: the expert files of layer {li} do not all hold {key}.E")
            tensors[key] = {FP32: torch.stack([files[e][f"{key}.{e}"].float() for e in range(count)])}
    for e, optim in enumerate(optims):
        shapes = [(tensors[n][FP32].shape[0] // ep, *tensors[n][FP32].shape[1:]) for n in local_names]
        expert_states.append(states(optim, 1, local_names, shapes, EXPP.format(e)))
    for i, name in enumerate(local_names):
        for k in [k for k, v in expert_states[0][i].items() if torch.is_tensor(v) and v.dim() > 0]:
            tensors[name][k] = torch.cat([expert_states[e][i][k] for e in range(ep)])
    scalars = [_scalars(dense_states[0]), _scalars(expert_states[0][0])]
    return autoep_checkpoint(tag_dir, 0, dp, model, tensors, scalars, groups, None, names)
