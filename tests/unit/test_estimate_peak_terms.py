"""The peak model's pure terms (zerospeed.estimate.peak), by hand and against torch modules.

The comparison with a measured run is tests/dist/test_estimate_peak.py; here: the parameter layout
against the torch module itself, the activation counts and one stage's phases by hand, and the plan
choosing by the peak."""

import pytest

from zerospeed.estimate import ModelCensus, Setup, plan_rows, recommend
from zerospeed.estimate.census import census_of_config
from zerospeed.estimate.formulas import Option, Precision
from zerospeed.estimate.layout import TransformerShape
from zerospeed.estimate.peak import (
    EngineKnobs,
    Workload,
    block_working_set,
    module_params,
    peak_terms,
    persistent_units,
    saved_activations,
)
from zoo.models import GPT, GPTConfig

SHAPE = TransformerShape(layers=2, hidden=8, vocab=16, heads=2, positions=4)


def test_module_params_follow_the_torch_module():
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8))
    seen, own = set(), []
    for m in model.modules():  # a tied parameter belongs to its first module, as stage 3's units
        ps = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            own.append([p.numel() for p in ps])
    assert [ps for _, ps in module_params(SHAPE)] == own
    assert sum(n for _, ps in module_params(SHAPE) for n in ps) == model.num_parameters()


def test_activations_by_hand():
    w = Workload(micro_batch=2, seq_len=4)
    sbh, sbv = 4 * 2 * 8, 4 * 2 * 16
    assert saved_activations(SHAPE, w) == 2 * 16 * sbh + 2 * sbh + sbv == 2304
    assert saved_activations(SHAPE, Workload(2, 4, checkpointing=True)) == 2 * sbh + 2 * sbh + sbv
    assert saved_activations(SHAPE, Workload(2, 4, attention="eager")) == 2304 + 2 * (2 * 4 * 4 * 2)
    assert block_working_set(SHAPE, w) == 8 * sbh
    assert block_working_set(SHAPE, Workload(2, 4, checkpointing=True)) == 24 * sbh


def test_stage0_phases_by_hand():
    p = peak_terms(SHAPE, 2, Option(0), Precision.of("fp32", "adamw", "fp32"), Workload(2, 4))
    n = sum(x for _, ps in module_params(SHAPE) for x in ps)
    sbh, sbv = 64, 128
    states = 16 * n
    acts = 4 * (2 * 16 * sbh + 2 * sbh + sbv)
    assert p.phases["forward"] == states + acts + 4 * sbv
    assert p.phases["backward_start"] == states + acts + 4 * 2 * sbv
    assert p.phases["backward_first_gradient"] == states + acts - 4 * (2 * sbh + sbv) + 4 * 8 * sbh + 4 * 16 * 8
    assert p.phases["step"] == states + 2 * 4 * (4 * 8 * 8)  # two temporaries of the largest tensor (MLP fc)
    assert p.total == max(p.phases.values()) and p.phase == "backward_first_gradient"
    assert p.dominant == "optimizer_states"  # 8 bytes per parameter outweigh these tiny activations


def test_persistent_units_respect_both_thresholds():
    assert persistent_units([10, 200, 30, 5], EngineKnobs(param_persistence_threshold=50)) == 45
    assert (
        persistent_units([10, 200, 30, 5], EngineKnobs(param_persistence_threshold=50, model_persistence_threshold=40))
        == 40
    )


def test_offloaded_step_has_no_device_temporaries():
    prec = Precision.of("bf16", "adamw", "fp32")
    assert peak_terms(SHAPE, 2, Option(2, True), prec, Workload(2, 4)).terms["optimizer_temporaries"] == 0
    assert peak_terms(SHAPE, 2, Option(2), prec, Workload(2, 4)).terms["optimizer_temporaries"] > 0


def test_plan_rows_carry_the_peak_and_recommend_by_it():
    census = census_of_config({"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 1024, "block_size": 64})
    rows = plan_rows(census, Setup(devices_per_node=2, precision="fp32", micro_batch=4, seq_len=64, backend="gloo"))
    by = {r.label(): r for r in rows}
    s0, s3 = by["stage 0"], by["stage 3"]
    assert s0.peak is not None and s0.peak.total > sum(s0.peak.states.values())
    budget = 1.03 * s3.peak.total
    assert s0.peak.total > budget  # stage 0 would not fit; something at stage <= 3 does
    assert recommend(rows, budget).device_need <= budget
    # without a shape (a bare parameter count) there is no peak, and the plan is as before
    assert all(r.peak is None for r in plan_rows(ModelCensus(10**6, 0), Setup()))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_more_ranks_never_raise_the_peak(stage):
    prec, w = Precision.of("fp32", "adamw", "fp32"), Workload(4, 64)
    shape = TransformerShape(4, 256, 1024, 4, positions=64)
    totals = [peak_terms(shape, n, Option(stage), prec, w, EngineKnobs(overlap_comm=False)).total for n in (2, 4, 8)]
    assert totals == sorted(totals, reverse=True)


def test_a_loss_that_upcasts_the_logits_by_hand():
    """transformers' ForCausalLMLoss casts the logits to fp32: in bf16 the log-probabilities, the fp32
    copy of the logits and the loss's two gradients cost 6*s*b*V bytes more at forward and at the start
    of backward (2 for the saved log-probabilities, 4 for the copy / the second fp32 gradient); none once
    the head is freed. In fp32 the cast is a no-op and nothing changes."""
    sbv = 4 * 2 * 16
    for dtype, more in (("bf16", 6 * sbv), ("fp32", 0)):
        prec, a = Precision.of(dtype, "adamw", "fp32"), 2 if dtype == "bf16" else 4
        plain = peak_terms(SHAPE, 2, Option(0), prec, Workload(2, 4, act_bytes=a))
        upcast = peak_terms(SHAPE, 2, Option(0), prec, Workload(2, 4, act_bytes=a, loss_upcast=True))
        assert upcast.phases["forward"] - plain.phases["forward"] == more
        assert upcast.phases["backward_start"] - plain.phases["backward_start"] == more
        assert upcast.phases["backward_first_gradient"] == plain.phases["backward_first_gradient"]
        assert upcast.phases["step"] == plain.phases["step"]
