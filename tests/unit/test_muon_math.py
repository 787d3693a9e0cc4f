"""Muon's arithmetic (zerospeed/optim/muon.py) against DeepSpeed 0.19.8's recorded `muon_update`, against
the formulas, and its configuration: which parameters use it, how param groups split, what is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zerospeed.optim.factory import build_optimizer
from zerospeed.optim.muon import MuonWithAuxAdam, muon_param_groups, muon_update, ns_compute_dtype, uses_muon
from zerospeed.utils.errors import ConfigError

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_0.19.8" / "muon" / "muon_update.json"


def _quintic(u: torch.Tensor) -> torch.Tensor:
    """Five quintic Newton-Schulz steps in float64 on the wide orientation (the formula, not the kernel)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.double()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(5):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


@pytest.mark.skipif(not CASES.exists(), reason="muon_update.json not recorded yet")
def test_muon_update_is_deepspeeds_bitwise():
    """The same inputs give DeepSpeed's own (eager) update and momentum, bit for bit, in both methods."""
    for case in json.loads(CASES.read_text()):
        grad, momentum = torch.tensor(case["grad"]), torch.tensor(case["momentum"])
        update = muon_update(grad, momentum, beta=0.9, ns_method=case["ns_method"])
        where = f"{case['shape']} {case['ns_method']}"
        assert torch.equal(update, torch.tensor(case["update"])), where
        assert torch.equal(momentum, torch.tensor(case["new_momentum"])), where


@pytest.mark.parametrize("shape", [(12, 8), (6, 12), (7, 7), (3, 5, 4)])
def test_muon_update_follows_the_formula(shape):
    torch.manual_seed(0)
    grad, momentum = torch.randn(shape), torch.randn(shape)
    m = 0.9 * momentum + 0.1 * grad
    expected = _quintic(0.9 * m + 0.1 * grad) * math.sqrt(max(1.0, shape[-2] / shape[-1]))
    got = muon_update(grad.clone(), momentum, beta=0.9, ns_method="gram")
    torch.testing.assert_close(momentum, m, atol=1e-6, rtol=0)
    # gram runs in fp32 where the accelerator has no fp16 kernels (this CPU), else in fp16
    tol = 1e-5 if ns_compute_dtype("gram") == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=0)


def test_newton_schulz_dtype_follows_deepspeeds_policy():
    assert ns_compute_dtype("standard") == torch.bfloat16  # every CPU has bf16 (DeepSpeed's CPU accelerator)
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert ns_compute_dtype("gram") == (torch.float16 if fp16 else torch.float32)


def test_a_non_finite_gradient_keeps_the_momentum():
    grad, momentum = torch.ones(4, 3), torch.full((4, 3), 0.5)
    grad[1, 2] = float("inf")
    update = muon_update(grad, momentum, beta=0.9)
    assert torch.equal(momentum, torch.full((4, 3), 0.5))
    assert not torch.isfinite(update).all()


def test_convolution_filters_are_viewed_as_matrices():
    """A 4-D filter runs Newton-Schulz as (out, in*kh*kw); the shape factor reads the last two dims (kh, kw),
    DeepSpeed's arithmetic (DeepSpeed itself then fails to return the 2-D update in the filter's shape)."""
    torch.manual_seed(0)
    grad = torch.randn(4, 2, 3, 2)
    update = muon_update(grad.clone(), torch.zeros_like(grad), beta=0.9)
    flat = (0.9 * (0.1 * grad) + 0.1 * grad).view(4, -1)
    want = (_quintic(flat) * math.sqrt(3 / 2)).view(grad.shape)
    assert update.shape == grad.shape
    tol = 1e-5 if ns_compute_dtype("gram") == torch.float32 else 2e-2
    torch.testing.assert_close(update.double(), want, atol=tol, rtol=0)


def test_deepspeeds_rule_for_which_parameters_use_muon():
    assert uses_muon("layers.0.fc1.weight", 2)
    assert uses_muon("conv.weight", 4)
    assert not uses_muon("layers.0.fc1.bias", 1)
    assert not uses_muon("model.Embed_tokens.weight", 2)
    assert not uses_muon("lm_head.weight", 2)


def test_param_groups_split_with_deepspeeds_precedence():
    a, b, c = (
        torch.nn.Parameter(torch.zeros(3, 2)),
        torch.nn.Parameter(torch.zeros(2)),
        torch.nn.Parameter(torch.zeros(2)),
    )
    flags = {id(a): True, id(b): False, id(c): False}
    params = {"lr": 0.1, "muon_lr": 0.05, "momentum": 0.8, "betas": (0.8, 0.9), "weight_decay": 0.1}
    groups = [{"params": [a, b], "momentum": 0.7}, {"params": [c], "weight_decay": 0.0, "name": "no_decay"}]
    out = muon_param_groups(groups, flags, params)
    assert [(g["name"], g["use_muon"], len(g["params"])) for g in out] == [
        ("group0-muon-params", True, 1),
        ("group0-adam-params", False, 1),
        ("no_decay-adam-params", False, 1),
    ]
    assert (out[0]["lr"], out[0]["momentum"], out[0]["weight_decay"]) == (0.05, 0.7, 0.1)
    assert (out[1]["lr"], out[1]["betas"], out[1]["weight_decay"]) == (0.1, (0.8, 0.9), 0.1)
    assert "momentum" not in out[1] and "betas" not in out[0]
    assert out[2]["weight_decay"] == 0.0
    # one incoming group keeps DeepSpeed's historical names
    assert [g["name"] for g in muon_param_groups([{"params": [a, b]}], flags, {})] == ["muon-params", "adam-params"]


def test_optimizer_defaults_and_steps_match_the_formulas():
    """DeepSpeed's defaults (Muon lr 0.02, momentum 0.95; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10) and
    three steps: the Adam half equals torch's AdamW, the Muon half the formula."""
    torch.manual_seed(0)
    w, bias = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5))
    w_ref, bias_ref = w.detach().clone(), torch.nn.Parameter(bias.detach().clone())
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": True}, {"params": [bias], "use_muon": False}])
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["momentum"] == 0.95
    assert opt.param_groups[1]["betas"] == (0.9, 0.95) and opt.param_groups[1]["eps"] == 1e-10
    adamw = torch.optim.AdamW([bias_ref], lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    m = torch.zeros_like(w_ref)
    for _ in range(3):
        g_w, g_b = torch.randn(5, 3), torch.randn(5)
        w.grad, bias.grad, bias_ref.grad = g_w.clone(), g_b.clone(), g_b.clone()
        opt.step()
        adamw.step()
        m = 0.95 * m + 0.05 * g_w
        w_ref -= 0.02 * (_quintic(0.95 * m + 0.05 * g_w) * math.sqrt(5 / 3)).float()
    tol = 1e-5 if ns_compute_dtype("gram") == torch.float32 else 2e-3
    torch.testing.assert_close(w.detach(), w_ref, atol=tol, rtol=0)
    torch.testing.assert_close(bias.detach(), bias_ref.detach(), atol=1e-6, rtol=0)


def _tagged_groups():
    w, b = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3))
    w.use_muon, b.use_muon = True, False
    return [w, b]


def test_factory_builds_muon_from_tagged_parameters():
    opt = build_optimizer("Muon", {"muon_lr": 0.01, "adam_lr": 0.001, "ns_method": "standard"}, _tagged_groups())
    assert isinstance(opt, MuonWithAuxAdam)
    assert [(g["use_muon"], g["lr"]) for g in opt.param_groups] == [(True, 0.01), (False, 0.001)]
    assert opt.param_groups[0]["ns_method"] == "standard"


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"momentun": 0.9}, r"optimizer\.params: Muon does not take \['momentun'\] \(did you mean"),
        ({"per_head_muon": True}, r"optimizer\.params\.per_head_muon"),
        ({"ns_method": "svd"}, r"optimizer\.params\.ns_method"),
    ],
)
def test_factory_refuses_what_it_does_not_do(params, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer("muon", params, _tagged_groups())


def test_factory_needs_every_parameter_tagged():
    with pytest.raises(ConfigError, match="use_muon"):
        build_optimizer("Muon", {}, [torch.nn.Parameter(torch.zeros(3, 2))])


# -- initialize's part: DeepSpeed's tagging of the model and its refusals --------------------------------------
def _cfg(**zero):
    from zerospeed.config import parse_config

    return parse_config(
        {"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {"muon_lr": 0.01}}, "zero_optimization": zero},
        world_size=1,
    )


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(5, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 5, bias=False)


def test_initialize_tags_the_model_as_deepspeed_does():
    from zerospeed.runtime.initialize import _muon_halves

    m = _Tiny()
    m.fc.bias.use_muon = True  # overwritten, as DeepSpeed's set_optimizer_flags does
    groups = _muon_halves(m, [{"params": list(m.parameters())}], _cfg(stage=2))
    assert [(g["name"], [p.shape for p in g["params"]]) for g in groups] == [
        ("muon-params", [torch.Size([4, 4])]),
        ("adam-params", [torch.Size([5, 4]), torch.Size([4]), torch.Size([5, 4])]),
    ]
    assert groups[0]["lr"] == 0.01 and "lr" not in groups[1]
    with pytest.raises(ConfigError, match="not parameters of `model`"):
        _muon_halves(m, [{"params": [torch.nn.Parameter(torch.zeros(2, 2))]}], _cfg(stage=2))


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        ({"stage": 3}, r'zero_optimization\.reduce_scatter: Muon and reduce scatter.*"reduce_scatter": false'),
        ({"stage": 3, "reduce_scatter": False, "zero_quantized_gradients": True}, "zero_quantized_gradients"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "offload_optimizer.device 'nvme'"),
    ],
)
def test_initialize_refuses_what_deepspeed_refuses(zero, match):
    from zerospeed.runtime.initialize import _muon_halves

    m = _Tiny()
    with pytest.raises(ConfigError, match=match):
        _muon_halves(m, [{"params": list(m.parameters())}], _cfg(**zero))
