"""DeepSpeed behaviours that user code and DeepSpeed's own tests rely on (issue 49), one test each.

The expected values are DeepSpeed 0.19.8's: recorded from the real DeepSpeed (CPU accelerator, one process)
by the script below, or its documented semantics where named. One-process engines, no spawned ranks.

    # /tmp/record.py: a 4 -> 4 Linear model whose module has `id = 3`; SGD; micro-batch 1
    DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \\
        /work/dsvenv/bin/python /tmp/record.py
    {"version": "0.19.8", "was_step_applied_gas4": [false, false, false, true, false, false, false, true],
     "engine_id": 3, "scale_non_scalar": ["AssertionError", ...], "initialize_model_none": ["AssertionError", ...],
     "tag_validation_invalid": ["DeepSpeedConfigError", ...], "force_ds_cpu_optimizer": ["ZeRORuntimeException", ...],
     "force_ds_cpu_optimizer_default": ["ZeRORuntimeException", ...]}

The last one is a deliberate difference (docs/compat.md, "Behaviours"): zerospeed accepts a client optimizer
under optimizer offload unless the config sets `zero_force_ds_cpu_optimizer: true` itself.
"""

from __future__ import annotations

import json

import pytest
import torch

import zerospeed
from harness.deepspeed_models import SkipInitModel
from zerospeed.checkpoint.errors import CheckpointError, CheckpointTagError
from zerospeed.config.loader import load_raw
from zerospeed.moe.gating import top1gating, top2gating, topkgating
from zerospeed.optim.adam import DeepSpeedCPUAdam
from zerospeed.utils.errors import ConfigError, DeepSpeedConfigError, ZeRORuntimeException
from zerospeed.zero.stage3.api import GatheredParameters, Init, ZeroParamStatus

RECORDED_WAS_STEP_APPLIED_GAS4 = [False, False, False, True, False, False, False, True]


class IdModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.id = 3  # arbitrary client state (DeepSpeed's TestZero3ClientModuleID)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).pow(2).mean()

    def helper(self) -> str:
        return "the module's"


def _engine(config: dict, model: torch.nn.Module | None = None, **kwargs):
    torch.manual_seed(0)
    model = model or IdModel()
    engine, *_ = zerospeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, **config}, **kwargs)
    return engine


SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_was_step_applied_is_true_only_on_the_micro_step_that_stepped():
    engine = _engine({**SGD, "gradient_accumulation_steps": 4})
    applied = []
    for _ in range(8):
        loss = engine(torch.randn(1, 4))
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == RECORDED_WAS_STEP_APPLIED_GAS4


def test_unknown_attributes_pass_through_to_the_module():
    engine = _engine(SGD)
    assert engine.id == 3  # recorded: DeepSpeed's engine.id is the module's
    assert engine.helper() == "the module's"
    assert engine.module.fc is engine.fc
    assert engine.gradient_accumulation_steps() == 1  # the engine's own names win
    with pytest.raises(AttributeError, match="no_such_thing"):
        engine.no_such_thing  # noqa: B018
    assert not hasattr(engine, "no_such_thing")


def test_scale_of_a_non_scalar_loss_is_an_assertion_error():
    engine = _engine(SGD)
    loss = engine.module.fc(torch.randn(2, 4)).sum(dim=1)
    with pytest.raises(AssertionError, match="one-element tensor"):  # recorded: AssertionError
        engine.scale(loss)
    with pytest.raises(ValueError):  # and still what zerospeed raised before
        engine.scale(loss)


# recorded from DeepSpeed 0.19.8 (SGD, `zero_allow_untested_optimizer`): `with engine.no_sync(): with engine.no_sync()`
RECORDED_NO_SYNC = {
    1: ["AssertionError", "no_sync context manager reentry is unsupported"],
    2: ["AssertionError", "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2"],
}


@pytest.mark.parametrize("stage", [1, 2])
def test_no_sync_refusals_are_assertion_errors(stage):
    """ZeRO 2 refuses no_sync() and every stage refuses it nested or a step inside it, with DeepSpeed's
    AssertionError and message (still a RuntimeError, as zerospeed raised before); leaving the block re-allows it."""
    engine = _engine({**SGD, "zero_optimization": {"stage": stage}})
    kind, message = RECORDED_NO_SYNC[stage]
    with pytest.raises(AssertionError, match=message) as info:
        with engine.no_sync():
            with engine.no_sync():
                pass
    assert kind == "AssertionError" and isinstance(info.value, RuntimeError)
    if stage == 1:  # DeepSpeed's test_no_sync_ctxt.py: a step inside is refused, and the block can be entered again
        with engine.no_sync():
            engine.backward(engine(torch.randn(1, 4)))
            with pytest.raises(AssertionError, match=r"It is illegal to call Engine.step\(\) inside no_sync"):
                engine.step()
        with engine.no_sync():
            pass


def test_count_used_parameters_in_backward():
    """DeepSpeed's documented semantics: from a hook during backward, the number of parameters whose gradient
    the running backward produces (unused and frozen ones not counted); outside a backward, a RuntimeError."""
    from zerospeed.utils.tensors import count_used_parameters_in_backward

    used, unused, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    frozen.requires_grad_(False)
    seen = []
    used.register_hook(lambda g: seen.append(count_used_parameters_in_backward([used, unused, frozen, used])))
    (used * frozen).sum().backward()
    assert seen == [1]
    (used.sum() + unused.sum()).backward()  # both reached now
    assert seen == [1, 2]
    with pytest.raises(RuntimeError, match="while a backward is running"):
        count_used_parameters_in_backward([used])


def test_initialize_without_a_model_is_an_assertion_error():
    with pytest.raises(AssertionError, match="`model` is required"):  # recorded: AssertionError
        zerospeed.initialize(model=None, config={"train_micro_batch_size_per_gpu": 1})


def test_invalid_tag_validation_is_a_deepspeed_config_error():
    with pytest.raises(DeepSpeedConfigError, match="tag_validation") as info:  # recorded: DeepSpeedConfigError
        _engine({**SGD, "checkpoint": {"tag_validation": "foo"}})
    assert isinstance(info.value, ConfigError)


def test_checkpoint_tag_mismatch_error_is_an_assertion_error():
    # DeepSpeed's _checkpoint_tag_validation: `assert valid, msg` under FAIL (runtime/engine.py)
    assert issubclass(CheckpointTagError, AssertionError) and issubclass(CheckpointTagError, CheckpointError)


OFFLOAD = {
    **SGD,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
}


def test_forced_ds_cpu_optimizer_refuses_a_client_optimizer_under_offload():
    model = IdModel()
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer") as info:  # recorded
        _engine({**OFFLOAD, "zero_force_ds_cpu_optimizer": True}, model, optimizer=torch.optim.Adam(model.parameters()))
    assert isinstance(info.value, ConfigError)


def test_forced_ds_cpu_optimizer_accepts_deepspeeds_cpu_adam_and_the_default_accepts_any():
    model = IdModel()
    config = {**OFFLOAD, "zero_force_ds_cpu_optimizer": True}
    _engine(config, model, optimizer=DeepSpeedCPUAdam(model.parameters())).destroy()
    model = IdModel()  # the key left at its default: accepted (Note [forced CPU optimizer], runtime/initialize.py)
    _engine(OFFLOAD, model, optimizer=torch.optim.Adam(model.parameters())).destroy()


class _Untested(torch.optim.SGD):
    """Not one of the optimizers ZeRO is tested with."""


@pytest.mark.parametrize("flag", [1, True])
def test_allow_untested_optimizer_as_one(flag):
    model = IdModel()
    config = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": flag}
    engine = _engine(config, model, optimizer=_Untested(model.parameters(), lr=0.1))
    assert engine.zero_allow_untested_optimizer() is True
    model = IdModel()
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        _engine({**config, "zero_allow_untested_optimizer": 0}, model, optimizer=_Untested(model.parameters(), lr=0.1))


def test_a_string_is_still_not_a_boolean():
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer: expected true or false"):
        _engine({**SGD, "zero_allow_untested_optimizer": "false"})


HJSON = """
# DeepSpeed reads its config files with hjson: comments, unquoted keys and strings, no commas
{
  train_micro_batch_size_per_gpu: 2  // micro-batch
  gradient_accumulation_steps: 3
  optimizer: {
    type: AdamW
    params: {lr: 0.001}
  }
  zero_optimization: {stage: 2}
}
"""


def test_an_hjson_config_file_loads(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    expected = {  # the same document written as JSON
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 2},
    }
    assert load_raw(str(path)) == expected
    engine, *_ = zerospeed.initialize(model=IdModel(), config=str(path))
    assert engine.gradient_accumulation_steps() == 3 and engine.zero_optimization_stage() == 2


def test_hjson_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.hjson"
    path.write_text("{\n a: 1\n a: 2\n}")
    with pytest.raises(ConfigError, match="duplicate key a"):
        load_raw(str(path))


def test_json_errors_keep_their_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"a": 1})[:-1] + ', "b": [}')
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_raw(str(path))


# -- MoE gating: sparse_routes ------------------------------------------------------------------------------


def _combine_from_routes(shape, sparse) -> torch.Tensor:
    """DeepSpeed's reading of the sparse form (tests/unit/v1/moe/test_moe.py `_assert_sparse_routes_match`):
    every kept route (expert index >= 0) puts its gate at (token, expert, location)."""
    _, capacity, num_experts, indices_KS, locations_KS, gates_KS, _ = sparse
    out = torch.zeros(shape)
    for indices, locations, gates in zip(indices_KS, locations_KS, gates_KS):
        for s in range(indices.numel()):
            if indices[s] >= 0:
                out[s, indices[s], locations[s]] += gates[s]
    assert out.shape[1:] == (num_experts, int(capacity))
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_describe_the_dense_combine_weights(k):
    torch.manual_seed(k)
    logits = torch.randn(16, 4)
    if k == 1:
        dense, sparse = (top1gating(logits, 1.0, 0, use_rts=False, sparse_routes=s) for s in (False, True))
    elif k == 2:
        dense, sparse = (
            top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False, sparse_routes=s) for s in (False, True)
        )
    else:
        dense, sparse = (topkgating(logits, k, 1.0, 0, sparse_routes=s) for s in (False, True))
    assert len(sparse) == 7 and sparse[3].shape == (k, 16) and sparse[3].dtype == torch.int32
    assert sparse[2] == 4 and sparse[1] == dense[1].shape[2]
    torch.testing.assert_close(_combine_from_routes(dense[1].shape, sparse), dense[1])
    torch.testing.assert_close(sparse[0], dense[0])
    dropped = (sparse[3] < 0).sum().item()
    assert dropped == k * 16 - int(dense[2].sum())  # a dropped route is flagged -1, a kept one fills one slot


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_dispatch_equals_the_dense_einsums(k):
    """DeepSpeed's sparse dispatch helpers (`deepspeed.moe.sharded_moe._route_slots`, `_sparse_encode`,
    `_sparse_decode`) against the dense form's einsums (its test_sparse_dispatch_matches_dense)."""
    from zerospeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

    torch.manual_seed(k)
    logits, x_SM = torch.randn(16, 4), torch.randn(16, 8)
    dense, sparse = (topkgating(logits, k, 1.0, 0, sparse_routes=s) for s in (False, True))
    cap = int(sparse[1])
    slots = _route_slots(sparse[3], sparse[4], 4, cap)
    torch.testing.assert_close(_sparse_encode(x_SM, slots, 4, cap), torch.einsum("sec,sm->ecm", dense[2].float(), x_SM))
    out_ECM = torch.randn(4, cap, 8)
    expected = torch.einsum("sec,ecm->sm", dense[1], out_ECM)
    torch.testing.assert_close(_sparse_decode(out_ECM.view(4 * cap, 8), slots, sparse[5], 16), expected)


def test_sparse_routes_through_the_gate_module():
    from zerospeed.moe.sharded_moe import TopKGate

    gate = TopKGate(8, 4, k=2, capacity_factor=1.0, min_capacity=0, top2_2nd_expert_sampling=False)
    x = torch.randn(16, 8)
    dense, sparse = gate(x), gate(x, sparse_routes=True)
    torch.testing.assert_close(_combine_from_routes(dense[1].shape, sparse), dense[1])


# -- zero.Init: DeepSpeed's keyword, skip_init, the ds_* views ------------------------------------------------


def test_skip_init_inside_zero_init_shards_every_parameter():
    zerospeed.init_distributed()
    with Init(mem_efficient_linear=False):  # DeepSpeed's keyword, accepted
        model = SkipInitModel()
    plain = SkipInitModel()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert p.ds_shape == q.shape and p.ds_numel == q.numel(), name
        assert p.numel() == 0, name  # sharded: no full copy
    # skip_init leaves the values uninitialised: give both models the same ones, then train one step each
    with GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        for i, (p, q) in enumerate(zip(model.parameters(), plain.parameters())):
            p.fill_(0.01 * (i + 1))
            q.fill_(0.01 * (i + 1))
    engine = _engine(SGD | {"gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}, model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randn(1, 10)
    for _ in range(2):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        expected = plain(x)
        optimizer.zero_grad()
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected)


def test_ds_views_under_zero3():
    engine = _engine(SGD | {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    plain = IdModel()
    counted = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    assert counted == sum(p.numel() for p in plain.parameters())  # the idiom DeepSpeed users count with
    weight = engine.module.fc.weight
    assert weight.ds_shape == (4, 4)
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    ids = [p.ds_id for p in engine.module.parameters()]
    assert len(set(ids)) == len(ids)
    # one rank: this rank's parts are the whole parameters, in the shard
    assert weight.ds_tensor.numel() + engine.module.fc.bias.ds_tensor.numel() == 20
    with GatheredParameters(weight):
        assert weight.ds_status is ZeroParamStatus.AVAILABLE
        torch.testing.assert_close(weight.ds_tensor.view(4, 4), weight.detach())
    with pytest.raises(AttributeError):
        weight.ds_numel = 3  # read-only
    assert not hasattr(plain.fc.weight, "ds_numel")


# -- DeepSpeedCPUAdam's fp32 moments, sharded_moe's `dist` and `_AllToAll`, runtime.utils.clip_grad_norm_ ----------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_adam_keeps_fp32_moments_for_16bit_parameters(dtype):
    """DeepSpeed's CPU Adam (fp32_optimizer_states=True, the default) keeps fp32 moments for a 16-bit
    parameter and updates in fp32, storing the parameter back in its dtype: against torch's fp32 AdamW on
    an fp32 copy that is rounded to `dtype` after every step."""
    torch.manual_seed(0)
    base = torch.randn(257).to(dtype)
    param, ref = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.float())
    ours = DeepSpeedCPUAdam([param], lr=1e-2, weight_decay=0.01)
    theirs = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01)
    for _ in range(6):
        grad = torch.randn(257).to(dtype)
        param.grad, ref.grad = grad.clone(), grad.float()
        ours.step()
        theirs.step()
        with torch.no_grad():
            ref.copy_(ref.to(dtype).float())
    assert param.dtype == dtype
    for key in ("exp_avg", "exp_avg_sq"):
        assert ours.state[param][key].dtype == torch.float32
        torch.testing.assert_close(ours.state[param][key], theirs.state[ref][key], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(param.float(), ref.detach(), rtol=0, atol=0)
    again = DeepSpeedCPUAdam([torch.nn.Parameter(param.detach().clone())])
    again.load_state_dict(ours.state_dict())  # torch would cast the moments to the parameter's dtype
    loaded = next(iter(again.state.values()))
    assert loaded["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(loaded["exp_avg_sq"], ours.state[param]["exp_avg_sq"], rtol=0, atol=0)
    half = DeepSpeedCPUAdam([p := torch.nn.Parameter(base.clone())], fp32_optimizer_states=False)
    p.grad = torch.ones_like(p)
    half.step()
    assert half.state[p]["exp_avg"].dtype == dtype  # DeepSpeed: the parameter's dtype without the flag


class _FakeGroup:
    """A stand-in expert-parallel group of two ranks (the collectives are patched below)."""


@pytest.mark.parametrize("gate", ["top1", "top2", "topk"])
def test_sharded_moe_capacity_all_reduce_goes_through_its_dist(monkeypatch, gate):
    """DeepSpeed's tests patch `deepspeed.moe.sharded_moe.dist` (its comm package): a dropless gate makes one
    all_reduce(op=ReduceOp.MAX, group=ep_group) there for a parallel ep group, and none at all — not even a
    size query — for ep_group=None (DeepSpeed's pg_utils.is_parallel: None is no parallelism)."""
    from zerospeed import comm
    from zerospeed.moe import sharded_moe

    assert sharded_moe.dist is comm and comm.ReduceOp.MAX == "max"
    fn = {"top1": sharded_moe.top1gating, "top2": sharded_moe.top2gating, "topk": sharded_moe.topkgating}[gate]
    args = (1, 0) if gate != "topk" else (3, 1, 0)
    group, calls = _FakeGroup(), []
    logits = torch.randn(8, 4)

    def all_reduce(tensor, op=comm.ReduceOp.SUM, group=None):
        calls.append((op, group))
        tensor.fill_(8)  # the other rank's largest expert count

    monkeypatch.setattr(sharded_moe.dist, "get_world_size", lambda g=None: 2 if g is group else 1)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", all_reduce)
    out = fn(logits, *args, drop_tokens=False, ep_group=group)
    assert calls == [(comm.ReduceOp.MAX, group)] and out[2].shape[-1] == 8  # the capacity is the group's maximum

    def fail(*args, **kwargs):
        raise AssertionError("ep_group=None made a collective")

    monkeypatch.setattr(sharded_moe.dist, "get_world_size", fail)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", fail)
    fn(logits, *args, drop_tokens=False, ep_group=None)


def test_moe_layer_exchanges_through_all_to_all_apply(monkeypatch):
    """DeepSpeed's MOELayer sends the dispatched slots and the expert outputs through `_AllToAll.apply(group,
    x)`: two calls per forward at ep_size 2, none at ep_size 1 (its test_all_to_all counts them)."""
    from zerospeed.moe import sharded_moe
    from zerospeed.moe.sharded_moe import MOELayer, TopKGate

    calls = []

    def counted(group, x):
        calls.append(group)
        return x

    monkeypatch.setattr(sharded_moe._AllToAll, "apply", counted)
    for ep_size, expected in ((1, 0), (2, 2)):
        calls.clear()
        layer = MOELayer(TopKGate(8, 2, k=1, min_capacity=0), torch.nn.Linear(8, 8), "ep_size_x", ep_size, 2 // ep_size)
        group = _FakeGroup()
        if ep_size > 1:
            layer._set_ep_group(group)
        layer(torch.randn(1, 4, 8))
        assert calls == [group] * expected


@pytest.mark.parametrize("norm_type", [2, 1, 3, float("inf")])
def test_runtime_utils_clip_grad_norm_is_torchs_on_one_rank(norm_type):
    """`deepspeed.runtime.utils.clip_grad_norm_` on one rank is torch.nn.utils.clip_grad_norm_: same norm,
    same clipped gradients (DeepSpeed's test_clipped_val); a parameter without a gradient is left out."""
    from zerospeed.parallel.clipping import clip_grad_norm_

    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(5)) for _ in range(4)]
        for p in ps[:3]:
            p.grad = torch.randn(5)
        return ps

    expected, actual = params(), params()
    norm = torch.nn.utils.clip_grad_norm_(expected[:3], 0.5, norm_type)
    torch.testing.assert_close(clip_grad_norm_(actual, 0.5, norm_type), norm)
    for e, a in zip(expected[:3], actual[:3]):
        torch.testing.assert_close(a.grad, e.grad)
    assert actual[3].grad is None


def test_one_cycle_step_ratio():
    """DeepSpeed's OneCycle.step_ratio: cycle_first_step_size / (first + second); 1.0 for a sawtooth."""
    from zerospeed.optim.schedulers import OneCycle

    def ratio(first, second):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return OneCycle(opt, 0.001, 0.1, cycle_first_step_size=first, cycle_second_step_size=second).step_ratio

    assert ratio(100, 0) == 1.0 and ratio(30, 70) == 0.3 and ratio(50, None) == 0.5
