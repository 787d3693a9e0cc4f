"""build_optimizer: DeepSpeed names and params, param groups, client optimizers, errors."""

import pytest
import torch

from zerospeed.optim import Lamb, Lion, build_optimizer, is_zero_tested_optimizer
from zerospeed.utils.errors import ConfigError


def params(n=2):
    return [torch.nn.Parameter(torch.ones(3)) for _ in range(n)]


@pytest.mark.parametrize("name", ["Adam", "adam", "ADAM"])
def test_adam_is_decoupled_adamw_by_default_with_deepspeed_weight_decay(name):
    opt = build_optimizer(name, {"lr": 0.1}, params())
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.0  # FusedAdam's default, not torch's 0.01
    assert opt.param_groups[0]["lr"] == 0.1


def test_adam_w_mode_false_is_l2_adam_and_deepspeed_knobs_are_consumed():
    opt = build_optimizer(
        "Adam",
        {"lr": 0.1, "adam_w_mode": False, "torch_adam": True, "bias_correction": True, "set_grad_none": True},
        params(),
    )
    assert type(opt) is torch.optim.Adam
    assert "adam_w_mode" not in opt.defaults and "torch_adam" not in opt.defaults


def test_torch_adam_true_keeps_torch_defaults():
    # DeepSpeed with torch_adam builds torch.optim.AdamW itself, so torch's weight_decay 0.01.
    opt = build_optimizer("AdamW", {"torch_adam": True}, params())
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.01


def test_adamw_ignores_adam_w_mode_false():
    opt = build_optimizer("AdamW", {"adam_w_mode": False, "weight_decay": 0.2, "betas": [0.8, 0.9]}, params())
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.2
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)  # JSON list becomes a tuple


def test_adam_bias_correction_false_is_refused():
    with pytest.raises(ConfigError, match="optimizer.params.bias_correction: false is not supported"):
        build_optimizer("Adam", {"bias_correction": False}, params())


def test_lamb_lion_sgd_adagrad():
    lamb = build_optimizer("LAMB", {"lr": 0.01, "max_coeff": 0.3, "bias_correction": False}, params())
    assert type(lamb) is Lamb and lamb.defaults["max_coeff"] == 0.3 and lamb.defaults["bias_correction"] is False
    lion = build_optimizer("lion", {"weight_decay": 0.1}, params())
    assert type(lion) is Lion
    # DeepSpeed FusedLion's defaults fill what the config leaves out.
    assert lion.defaults["lr"] == 1e-3 and lion.defaults["betas"] == (0.9, 0.999)
    sgd = build_optimizer("sgd", {"lr": 0.5, "momentum": 0.9}, params())
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    assert type(build_optimizer("Adagrad", None, params())) is torch.optim.Adagrad


def test_any_torch_optimizer_by_exact_name():
    opt = build_optimizer("RMSprop", {"lr": 0.01, "alpha": 0.9}, params())
    assert type(opt) is torch.optim.RMSprop and opt.defaults["alpha"] == 0.9
    assert type(build_optimizer("NAdam", {}, params())) is torch.optim.NAdam


def test_torch_names_are_case_sensitive_with_suggestion():
    with pytest.raises(ConfigError) as info:
        build_optimizer("rmsprop", {}, params())
    msg = str(info.value)
    assert "optimizer.type" in msg and "'rmsprop'" in msg and "RMSprop" in msg


def test_unknown_name_lists_closest():
    with pytest.raises(ConfigError) as info:
        build_optimizer("Adamm", {}, params())
    msg = str(info.value)
    assert "optimizer.type: unknown optimizer 'Adamm'" in msg and "'Adam'" in msg


@pytest.mark.parametrize("name", ["MuAdam", "MuAdamW", "MuSGD"])
def test_mup_optimizers_not_implemented(name):
    with pytest.raises(ConfigError, match=f"optimizer.type: '{name}'.*not implemented yet"):
        build_optimizer(name, {}, params())


@pytest.mark.parametrize(
    "name,cls,key,default",
    [
        ("OneBitAdam", "OnebitAdam", "freeze_step", 100000),
        ("ZeroOneAdam", "ZeroOneAdam", "var_freeze_step", 100000),
        ("OneBitLamb", "OnebitLamb", "freeze_step", 100000),
    ],
)
def test_one_bit_optimizers_by_config_name_with_deepspeed_defaults(name, cls, key, default):
    opt = build_optimizer(
        name,
        {"lr": 1e-3, "betas": [0.9, 0.99], "comm_backend_name": "nccl", "cuda_aware": False},
        params(),
        allow_untested=False,
    )
    assert type(opt).__name__ == cls and getattr(opt, key) == default
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        build_optimizer(name, {"max_grad_norm": 1.0}, params())
    with pytest.raises(ConfigError, match="comm_backend_name"):
        build_optimizer(name, {"comm_backend_name": "carrier-pigeon"}, params())


@pytest.mark.parametrize("bias_correction", [True, False])
def test_one_bit_adam_warm_up_is_adam(bias_correction):
    """Before freeze_step, on one process: torch's Adam (bias-corrected), or DeepSpeed's m / (sqrt(v) + eps)."""
    from zerospeed.optim.onebit import OnebitAdam

    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = OnebitAdam([a], lr=0.01, freeze_step=100, bias_correction=bias_correction)
    torch_adam = torch.optim.Adam([b], lr=0.01)
    m = v = torch.zeros_like(w0)
    manual = w0.clone()
    for _t in range(1, 6):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        torch_adam.step()
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        manual -= 0.01 * m / (v.sqrt() + 1e-8)
    torch.testing.assert_close(a.detach(), b.detach() if bias_correction else manual, atol=1e-6, rtol=0)


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ConfigError) as info:
        build_optimizer("Lamb", {"max_grad_norm": 1.0}, params())
    assert str(info.value) == "optimizer.params.max_grad_norm: not supported; use the top-level gradient_clipping"


def test_unknown_param_named_with_accepted_list():
    with pytest.raises(ConfigError) as info:
        build_optimizer("Adam", {"lr": 0.1, "momentum": 0.9}, params())
    msg = str(info.value)
    assert msg.startswith("optimizer.params.momentum: not accepted by AdamW")
    assert "'betas'" in msg and "'adam_w_mode'" in msg and "'eps'" in msg


def test_bad_param_value_becomes_config_error():
    with pytest.raises(ConfigError, match="optimizer.params: SGD rejected .*Invalid learning rate"):
        build_optimizer("SGD", {"lr": -1.0}, params())


def test_param_groups_keep_their_hyperparameters_and_drop_frozen():
    a, b, frozen = params(3)
    frozen.requires_grad_(False)
    only_frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    groups = [
        {"params": [a, frozen], "weight_decay": 0.0},
        {"params": b, "lr": 0.5, "weight_decay": 0.3},
        {"params": [only_frozen], "lr": 9.0},
    ]
    opt = build_optimizer("AdamW", {"lr": 0.1, "weight_decay": 0.01}, groups)
    assert len(opt.param_groups) == 2
    g0, g1 = opt.param_groups
    assert g0["params"] == [a] and (g0["lr"], g0["weight_decay"]) == (0.1, 0.0)
    assert g1["params"] == [b] and (g1["lr"], g1["weight_decay"]) == (0.5, 0.3)


def test_named_parameters_and_generators_accepted():
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    opt = build_optimizer("SGD", {"lr": 0.1}, model.named_parameters())
    assert opt.param_groups[0]["params"] == [model.weight]


def test_all_frozen_is_an_error():
    p = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    with pytest.raises(ConfigError, match="model_parameters: no parameter requires grad"):
        build_optimizer("SGD", {"lr": 0.1}, [p])


def test_mixed_tensors_and_groups_is_an_error():
    a, b = params()
    with pytest.raises(ConfigError, match="mixes tensors and param-group dicts"):
        build_optimizer("SGD", {"lr": 0.1}, [a, {"params": [b]}])


def test_group_without_params_key():
    with pytest.raises(ConfigError, match=r"model_parameters\[0\]: .*'params' key"):
        build_optimizer("SGD", {"lr": 0.1}, [{"lr": 0.1}])


def test_no_type_and_no_client_is_an_error():
    with pytest.raises(ConfigError, match="optimizer.type: no optimizer configured"):
        build_optimizer(None, None, params())


def test_client_optimizer_instance_wins_over_config():
    ps = params()
    client = torch.optim.SGD(ps, lr=0.3)
    assert build_optimizer("Adam", {"lr": 0.1}, ps, client) is client


def test_client_callable_gets_trainable_params_in_the_given_form():
    a, b = params()
    b.requires_grad_(False)
    seen = []

    def make(ps):
        seen.append([dict(g) if isinstance(g, dict) else g for g in ps])  # torch edits the dicts
        return torch.optim.SGD(ps, lr=0.2)

    opt = build_optimizer(None, None, [a, b], make)
    assert seen == [[a]] and type(opt) is torch.optim.SGD
    build_optimizer(None, None, [{"params": [a, b], "lr": 0.7}], make)
    assert seen[1] == [{"params": [a], "lr": 0.7}]


def test_client_of_wrong_kind():
    with pytest.raises(ConfigError, match="torch.optim.Optimizer or a callable"):
        build_optimizer(None, None, params(), client_optimizer=42)
    with pytest.raises(ConfigError, match="client callable returned int"):
        build_optimizer(None, None, params(), client_optimizer=lambda ps: 3)


def test_client_empty_groups_are_dropped():
    a = params(1)[0]
    client = torch.optim.SGD([{"params": [a]}, {"params": []}], lr=0.1)
    assert len(build_optimizer(None, None, [a], client).param_groups) == 1


def test_allow_untested_false_refuses_untested_optimizers():
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "Lion"):
        assert is_zero_tested_optimizer(build_optimizer(name, {}, params(), allow_untested=False))
    with pytest.raises(ConfigError) as info:
        build_optimizer("Lamb", {}, params(), allow_untested=False)
    msg = str(info.value)
    assert msg.startswith("zero_allow_untested_optimizer: Lamb is not tested with ZeRO")
    assert "trust ratio" in msg and '"zero_allow_untested_optimizer": true' in msg
    with pytest.raises(ConfigError, match="RMSprop is not tested"):
        build_optimizer("RMSprop", {}, params(), allow_untested=False)
    assert type(build_optimizer("Lamb", {}, params(), allow_untested=True)) is Lamb
