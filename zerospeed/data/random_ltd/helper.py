"""Random-LTD's user API (DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing.helper`): wrap a
model's transformer layers, bind them to the engine's scheduler, and save without the wrappers' names.

DeepSpeed's recipe, after `initialize`: `convert_to_random_ltd(engine, LayerClass)` wraps every
`LayerClass` module in a `RandomLayerTokenDrop` and calls `engine.random_ltd_initialize()`, which binds
the wrappers named by `random_ltd_layer_id` (in module order: the k-th bound one is random-LTD layer k)
and leaves the others running their layer unchanged. A wrapper's state-dict keys gain
`.random_ltd_layer`; `remove_random_ltd_state_dict` takes it out again.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from torch import nn

from zerospeed.data.random_ltd.layer import RandomLayerTokenDrop

_INNER = "random_ltd_layer"  # the wrapper's attribute holding the layer


def convert_to_random_ltd(model, convert_type: type):
    """Wrap each outermost `convert_type` module of `model` (an engine: its `.module`) in a
    `RandomLayerTokenDrop`; an engine then binds them (`random_ltd_initialize`). Returns `model`."""
    target = model.module if hasattr(model, "module") else model
    chosen: list[str] = []
    for name, module in target.named_modules():
        inside = any(name.startswith(outer + ".") for outer in chosen) or name.split(".")[-1] == _INNER
        if isinstance(module, convert_type) and not inside:
            if not name:
                raise ValueError(
                    f"convert_to_random_ltd: the model itself is a {convert_type.__name__}; pass the "
                    "model that holds the transformer layers"
                )
            chosen.append(name)
    for name in chosen:
        parent, _, child = name.rpartition(".")
        owner = target.get_submodule(parent)
        setattr(owner, child, RandomLayerTokenDrop(getattr(owner, child)))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def bind_random_ltd_layers(module: nn.Module, config: dict, scheduler) -> None:
    """DeepSpeed's `engine.random_ltd_initialize()`: walking `module` in order, bind each wrapper whose
    name has the next smallest id of `config["random_ltd_layer_id"]` as a dotted component ("h.3" for
    3; DeepSpeed tests the id as a substring of the name, so there "gpt3.h.0" would take id 3)."""
    pending = deque(sorted(config["random_ltd_layer_id"]))
    bound = []
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and pending and str(pending[0]) in name.split("."):
            layer.init_config(config, scheduler, len(bound))
            bound.append(name)
            pending.popleft()
    if len(bound) != config["random_ltd_layer_num"]:
        raise ValueError(
            f"random_ltd_layer_num={config['random_ltd_layer_num']} but {len(bound)} wrapped layer(s) "
            f"match random_ltd_layer_id {config['random_ltd_layer_id']} ({bound}; not found: "
            f"{list(pending)}): wrap the layers with convert_to_random_ltd(engine, LayerClass) and name "
            "them by the index in their module names (e.g. 3 for 'h.3')"
        )


def save_without_random_ltd(model) -> OrderedDict:
    """The state dict of `model` (an engine: its `.module`) under the unwrapped model's keys."""
    target = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(target.state_dict())


def remove_random_ltd_state_dict(state_dict: dict) -> OrderedDict:
    """`state_dict` with every `.random_ltd_layer` taken out of its keys."""
    return OrderedDict((key.replace("." + _INNER, ""), value) for key, value in state_dict.items())
