"""Lamb and Lion: exact values after one and two steps on tiny tensors, computed by hand."""

import copy
import math

import pytest
import torch

from zerospeed.optim import Lamb, Lion

f64 = torch.float64


def param(values, dtype=f64):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def step_with(opt, p, grad):
    p.grad = torch.tensor(grad, dtype=p.dtype)
    opt.step()


def assert_values(t, expected, tol=1e-12):
    assert t.detach().tolist() == pytest.approx(expected, rel=tol, abs=tol)


# ---------------------------------------------------------------- Lion


def test_lion_two_steps_exact():
    p = param([1.0, -2.0, 0.5])
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    step_with(opt, p, [0.5, -1.0, 0.0])
    # m = 0, so direction = sign(0.1 * g) = [1, -1, 0]; decay factor 1 - 0.1*0.1 = 0.99.
    assert_values(p, [0.99 - 0.1, -1.98 + 0.1, 0.495])
    assert_values(opt.state[p]["exp_avg"], [0.005, -0.01, 0.0])
    step_with(opt, p, [-0.04, -1.0, 2.0])
    # c = 0.9*m + 0.1*g = [0.0045 - 0.004, -0.009 - 0.1, 0.2]: the first entry follows the
    # momentum (+) against its gradient (-).
    assert_values(p, [0.89 * 0.99 - 0.1, -1.88 * 0.99 + 0.1, 0.495 * 0.99 - 0.1])
    assert_values(opt.state[p]["exp_avg"], [0.99 * 0.005 - 0.0004, -0.0099 - 0.01, 0.02])


def test_lion_defaults_and_per_group_hyperparameters():
    a, b = param([1.0]), param([1.0])
    opt = Lion([{"params": [a]}, {"params": [b], "lr": 0.5, "weight_decay": 1.0}])
    assert opt.defaults == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}
    a.grad = torch.tensor([2.0], dtype=f64)
    b.grad = torch.tensor([2.0], dtype=f64)
    opt.step()
    assert_values(a, [1.0 - 1e-4])
    assert_values(b, [1.0 * (1 - 0.5) - 0.5])


def test_lion_skips_params_without_grad():
    p, q = param([1.0]), param([2.0])
    opt = Lion([p, q], lr=0.1)
    step_with(opt, p, [1.0])
    assert_values(q, [2.0])
    assert q not in opt.state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lion_keeps_state_in_param_dtype(dtype):
    p = param([1.0, -1.0], dtype=dtype)
    opt = Lion([p], lr=0.25)
    step_with(opt, p, [1.0, -1.0])
    assert opt.state[p]["exp_avg"].dtype == dtype
    assert p.tolist() == [0.75, -0.75]  # exactly representable in every float dtype


def test_lion_rejects_bad_args():
    with pytest.raises(ValueError, match="betas\\[1\\]"):
        Lion([param([1.0])], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        Lion([param([1.0])], lr=-1.0)


# ---------------------------------------------------------------- Lamb


def test_lamb_one_step_exact():
    p = param([3.0, 4.0])  # ||p|| = 5
    opt = Lamb([p], lr=0.01, eps=0.0, weight_decay=0.1)
    step_with(opt, p, [1.0, -2.0])
    # Step 1 with bias correction: m_hat = g, v_hat = g^2, so m_hat/sqrt(v_hat) = sign(g).
    update = [1.0 + 0.3, -1.0 + 0.4]
    ratio = 5.0 / math.sqrt(1.3**2 + 0.6**2)
    assert_values(p, [3.0 - 0.01 * ratio * update[0], 4.0 - 0.01 * ratio * update[1]])
    assert opt.get_lamb_coeffs() == pytest.approx([ratio], rel=1e-12)
    assert_values(opt.state[p]["exp_avg"], [0.1, -0.2])
    assert_values(opt.state[p]["exp_avg_sq"], [0.001, 0.004])
    assert opt.state[p]["step"] == 1


def test_lamb_two_steps_exact():
    p = param([3.0, 4.0])
    opt = Lamb([p], lr=0.01, betas=(0.9, 0.999), eps=0.0, weight_decay=0.1)
    step_with(opt, p, [1.0, -2.0])
    p1 = p.detach().clone().tolist()
    step_with(opt, p, [0.5, 1.0])
    m = [0.9 * 0.1 + 0.1 * 0.5, 0.9 * -0.2 + 0.1 * 1.0]
    v = [0.999 * 0.001 + 0.001 * 0.25, 0.999 * 0.004 + 0.001 * 1.0]
    bc1, bc2 = 1 - 0.9**2, 1 - 0.999**2
    u = [(m[i] / bc1) / math.sqrt(v[i] / bc2) + 0.1 * p1[i] for i in range(2)]
    ratio = math.hypot(*p1) / math.hypot(*u)
    assert_values(p, [p1[i] - 0.01 * ratio * u[i] for i in range(2)], tol=1e-10)
    assert opt.state[p]["step"] == 2


def test_lamb_trust_ratio_clamped_to_max_and_min():
    big, tiny = param([300.0, 400.0]), param([0.003, 0.004])
    opt = Lamb([big, tiny], lr=0.1, eps=0.0)
    big.grad = torch.tensor([1.0, -2.0], dtype=f64)
    tiny.grad = torch.tensor([1.0, -2.0], dtype=f64)
    opt.step()
    # update = sign(g) = [1, -1], ||u|| = sqrt(2): 500/sqrt(2) -> 10, 0.005/sqrt(2) -> 0.01.
    assert opt.get_lamb_coeffs() == [10.0, 0.01]
    assert_values(big, [300.0 - 0.1 * 10.0, 400.0 + 0.1 * 10.0])
    assert_values(tiny, [0.003 - 0.001, 0.004 + 0.001])


def test_lamb_trust_ratio_is_one_for_zero_weights():
    p = param([0.0, 0.0])
    opt = Lamb([p], lr=0.1, eps=0.0, weight_decay=0.5)
    step_with(opt, p, [2.0, -3.0])
    assert opt.get_lamb_coeffs() == [1.0]
    assert_values(p, [-0.1, 0.1])


def test_lamb_eps_inside_vs_outside_sqrt():
    inside, outside = param([3.0, 4.0]), param([3.0, 4.0])
    opts = [Lamb([inside], lr=0.01, eps=0.25, eps_inside_sqrt=True), Lamb([outside], lr=0.01, eps=0.25)]
    for opt, p in zip(opts, (inside, outside)):
        step_with(opt, p, [1.0, -2.0])
    for p, u in (
        (inside, [1 / math.sqrt(1.25), -2 / math.sqrt(4.25)]),
        (outside, [1 / 1.25, -2 / 2.25]),
    ):
        ratio = 5.0 / math.hypot(*u)
        assert_values(p, [3.0 - 0.01 * ratio * u[0], 4.0 - 0.01 * ratio * u[1]])


def test_lamb_without_bias_correction():
    p = param([3.0, 4.0])
    opt = Lamb([p], lr=0.01, bias_correction=False, eps=0.0, weight_decay=0.1)
    step_with(opt, p, [1.0, -2.0])
    # m = 0.1 g, v = 0.001 g^2 uncorrected: m / sqrt(v) = (0.1 / sqrt(0.001)) * sign(g).
    c = 0.1 / math.sqrt(0.001)
    u = [c + 0.3, -c + 0.4]
    ratio = 5.0 / math.hypot(*u)
    assert_values(p, [3.0 - 0.01 * ratio * u[0], 4.0 - 0.01 * ratio * u[1]])


def test_lamb_bias_correction_uses_each_tensors_own_step_count():
    p, q = param([3.0, 4.0]), param([3.0, 4.0])
    opt = Lamb([p, q], lr=0.01, eps=0.0, weight_decay=0.1)
    step_with(opt, p, [1.0, -2.0])  # q has no grad: not stepped
    q.grad = torch.tensor([1.0, -2.0], dtype=f64)
    opt.step()  # p's second step, q's first
    assert int(opt.state[p]["step"]) == 2 and int(opt.state[q]["step"]) == 1
    ratio = 5.0 / math.sqrt(1.3**2 + 0.6**2)  # q's first step, as in test_lamb_one_step_exact
    assert_values(q, [3.0 - 0.01 * ratio * 1.3, 4.0 + 0.01 * ratio * 0.6])


def test_lamb_defaults_match_fused_lamb():
    opt = Lamb([param([1.0])])
    assert opt.defaults == {
        "lr": 1e-3,
        "bias_correction": True,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "eps_inside_sqrt": False,
        "weight_decay": 0.0,
        "max_coeff": 10.0,
        "min_coeff": 0.01,
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lamb_keeps_state_in_param_dtype(dtype):
    p = param([3.0, 4.0], dtype=dtype)
    opt = Lamb([p], lr=0.01)
    step_with(opt, p, [1.0, -2.0])
    assert opt.state[p]["exp_avg"].dtype == dtype and opt.state[p]["exp_avg_sq"].dtype == dtype
    assert torch.isfinite(p).all() and p.dtype == dtype


def test_lamb_state_dict_round_trip():
    p, q = param([3.0, 4.0]), param([3.0, 4.0])
    a = Lamb([p], lr=0.01, weight_decay=0.1)
    step_with(a, p, [1.0, -2.0])
    b = Lamb([q], lr=0.01, weight_decay=0.1)
    q.data.copy_(p.data)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as if saved and loaded
    step_with(a, p, [0.5, 1.0])
    step_with(b, q, [0.5, 1.0])
    assert torch.equal(p, q)


def test_lamb_rejects_bad_args():
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb([param([1.0])], min_coeff=1.0, max_coeff=0.5)
    with pytest.raises(TypeError):
        Lamb([param([1.0])], max_grad_norm=1.0)  # forbidden: use gradient_clipping
