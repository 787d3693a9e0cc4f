"""The checkpoint's inputs without an engine: the TrainingState's restore rules, and the protocols
modules answer instead of being recognised by class (no processes)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerospeed.checkpoint.experts import expert_spans
from zerospeed.checkpoint.protocols import (
    ExpertShare,
    HoldsExperts,
    SplitParameters,
    TensorParallelLayer,
    full_model_state,
    has_tensor_parallel_layers,
    model_layouts,
)
from zerospeed.checkpoint.slices import ShardSpec
from zerospeed.checkpoint.state import TrainingState, restore_training_state, training_state_dict
from zerospeed.checkpoint.tensor_parallel import TPLayout


class _Scheduler:
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"last_epoch": 3}

    def load_state_dict(self, state):
        self.loaded = state


def _state(gas=2, **parts):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": model.parameters(), "name": "dense", "moe": False}], lr=0.1, momentum=0.9)
    counters = SimpleNamespace(global_steps=0, global_samples=0, skipped_steps=0, micro_steps=0)
    return TrainingState(
        module=model,
        zero=None,
        optimizer=opt,
        mesh=None,
        counters=counters,
        gradient_accumulation_steps=gas,
        param_dtype=torch.float32,
        master_dtype=torch.float32,
        **parts,
    )


def test_saved_training_state_round_trips_into_live_counters():
    src = _state(lr_scheduler=_Scheduler())
    src.counters.__dict__.update(global_steps=5, global_samples=40, skipped_steps=1, micro_steps=11)
    saved = training_state_dict(src)
    assert saved["optimizer_type"] == "SGD" and saved["lr_scheduler"] == {"last_epoch": 3}
    assert saved["optimizer_param_groups"][0]["lr"] == 0.1 and "params" not in saved["optimizer_param_groups"][0]

    dst = _state(lr_scheduler=_Scheduler())
    dst.optimizer.param_groups[0]["lr"] = 1.0
    restore_training_state(dst, saved, with_optimizer=True, with_scheduler=True)
    c = dst.counters  # the very object the state was built with (Note [live counters])
    assert (c.global_steps, c.global_samples, c.skipped_steps, c.micro_steps) == (5, 40, 1, 11)
    assert dst.optimizer.param_groups[0]["lr"] == 0.1 and dst.lr_scheduler.loaded == {"last_epoch": 3}


def test_restore_rules():
    saved = {
        "optimizer_param_groups": [{"lr": 0.5, "momentum": 0.1, "name": "ep_size_2", "moe": True, "not_an_sgd_key": 1}],
        "global_steps": 4,
        "micro_steps": 9,
        "gradient_accumulation_steps": 3,
    }
    state = _state(gas=2)
    restore_training_state(state, saved, with_optimizer=False, with_scheduler=True)
    group = state.optimizer.param_groups[0]
    # a scheduler-only load takes just the lr; a group keeps its identity and its own keys
    assert (group["lr"], group["momentum"], group["name"], group["moe"]) == (0.5, 0.9, "dense", False)
    assert "not_an_sgd_key" not in group
    assert state.counters.micro_steps == 4 * 2  # another accumulation window: recounted from the steps
    restore_training_state(state, saved, with_optimizer=True, with_scheduler=False)
    assert group["momentum"] == 0.1


class _Experts(nn.Module):
    def __init__(self, share):
        super().__init__()
        self.share = share
        self.w = nn.Parameter(torch.zeros(2, 3))

    def checkpoint_experts(self):
        return self.share


def test_expert_spans_ask_the_protocol():
    model = nn.ModuleDict(
        {
            "a": _Experts(ExpertShare(first=4, local=2, writer=True, experts="list")),
            "b": _Experts(ExpertShare(first=2, local=2, writer=False, stacked=("w",), total=8)),
        }
    )
    assert isinstance(model["a"], HoldsExperts) and not isinstance(nn.Linear(1, 1), HoldsExperts)
    a, b = expert_spans(model)
    assert (a.layer, a.prefix, a.first, a.local, a.writer, a.stacked) == (0, "a.list", 4, 2, True, ())
    assert (b.layer, b.prefix, b.stacked, b.total, b.writer) == (1, "b", ("b.w",), 8, False)


class _ColumnSplit(nn.Module):
    """Rank 1 of 2 holding rows 2..3 of a [4, 3] weight, replicated bias; `full_parameter` plays the gather."""

    def __init__(self, full_weight):
        super().__init__()
        self.full = full_weight
        self.weight = nn.Parameter(full_weight[2:].clone())
        self.bias = nn.Parameter(torch.ones(3))
        self.specs = (ShardSpec(0, 4, ((0, 2),)), ShardSpec(0, 4, ((2, 2),)))

    def checkpoint_layouts(self):
        return {"weight": TPLayout(self.specs), "bias": None}

    def full_parameter(self, name):
        return self.full.clone() if name == "weight" else None


def test_tensor_parallel_protocol_layouts_and_full_state():
    full_weight = torch.arange(12.0).view(4, 3)
    layer = _ColumnSplit(full_weight)
    model = nn.Sequential(nn.Linear(3, 3), layer)
    model.register_buffer("step", torch.tensor(7))
    assert isinstance(layer, TensorParallelLayer) and isinstance(layer, SplitParameters)
    assert has_tensor_parallel_layers(model) and not has_tensor_parallel_layers(nn.Linear(1, 1))
    assert model_layouts(model) == {"1.weight": TPLayout(layer.specs)}  # the replicated bias has none

    state = full_model_state(model)
    reference = model.state_dict()
    assert list(state) == list(reference)
    torch.testing.assert_close(state["1.weight"], full_weight)
    for key in ("0.weight", "0.bias", "1.bias", "step"):
        torch.testing.assert_close(state[key], reference[key])
        assert state[key].data_ptr() != reference[key].data_ptr()  # fresh tensors, not views of the model


def test_tied_weights_stay_one_tensor_in_the_full_state():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    state = full_model_state(model)
    assert state["0.weight"] is state["1.weight"]


@pytest.mark.parametrize("value", [None, {}])
def test_an_absent_part_is_left_alone(value):
    scaler = _Scheduler()
    state = _state(loss_scaler=scaler)
    restore_training_state(state, {"loss_scaler": value}, with_optimizer=True, with_scheduler=True)
    assert scaler.loaded is None
