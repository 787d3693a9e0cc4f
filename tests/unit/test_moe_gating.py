"""MoE gating without processes: capacity, top-1 / top-2 / top-k routing, l_aux, exp_counts and their
gradients against independent per-token loops (harness.moe_reference); the random parts
(RTS, RSample, Jitter, second-expert sampling) by their properties."""

import copy

import pytest
import torch
from torch import nn

from harness.moe_reference import (
    ref_capacity,
    ref_counts,
    ref_l_aux,
    ref_moe_forward,
    ref_routes,
)
from zerospeed.moe import utils as moe_utils
from zerospeed.moe.gating import capacity, top1gating, top2gating, topkgating
from zerospeed.moe.layer import MoE
from zerospeed.moe.sharded_moe import TopKGate


def _logits(S=12, E=4, seed=0):
    return torch.randn(S, E, generator=torch.Generator().manual_seed(seed)) * 2


def _dense_combine(routes, S, E):
    """[S, E] weight of each (token, expert) from the reference routes."""
    w = torch.zeros(S, E)
    for s, kept in enumerate(routes):
        for e, g in kept:
            w[s, e] = w[s, e] + g
    return w


def _check_slots(combine, dispatch, cap):
    """Every slot of an expert holds at most one token; dispatch is exactly where combine weights live."""
    assert combine.shape[2] == cap
    assert int(dispatch.sum(dim=0).max()) <= 1
    assert torch.equal(dispatch, combine != 0)


@pytest.mark.parametrize(
    "S,E,cf,minc,want",
    [
        (12, 4, 1.0, 4, 4),
        (12, 4, 1.0, 0, 3),
        (8, 4, 2.0, 0, 4),
        (25, 1, 1.2, 0, 31),
        (50, 1, 1.1, 0, 55),
        (3, 4, 1.0, 0, 1),
        (100, 8, 1.25, 4, 16),
    ],
)
def test_capacity(S, E, cf, minc, want):
    assert capacity(S, E, cf, minc) == want == ref_capacity(S, E, cf, minc)


@pytest.mark.parametrize("drop", [True, False])
def test_top1_matches_loops(drop):
    S, E = 12, 4
    logits = _logits(S, E).requires_grad_()
    l_aux, combine, dispatch, counts = top1gating(logits, 1.0, 0, drop_tokens=drop, use_rts=False)
    ref_logits = logits.detach().clone().requires_grad_()
    cap = capacity(S, E, 1.0, 0) if drop else None
    routes, choices = ref_routes(ref_logits, 1, cap)
    want_l = ref_l_aux(ref_logits, choices, 1)
    assert counts.tolist() == ref_counts(choices, E)
    if not drop:
        assert combine.shape[2] == max(ref_counts(choices, E))
    _check_slots(combine, dispatch, combine.shape[2])
    got_w = combine.sum(dim=2)
    want_w = _dense_combine(routes, S, E)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(l_aux, want_l, rtol=0, atol=1e-6)
    # slots fill in token order
    for e in range(E):
        tokens = [s for s in range(S) if dispatch[s, e].any()]
        assert [int(dispatch[s, e].nonzero()) for s in tokens] == list(range(len(tokens)))
    probe = torch.randn(S, E, generator=torch.Generator().manual_seed(5))
    (got_w * probe).sum().add(l_aux).backward()
    (want_w * probe).sum().add(want_l).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-6)
    if drop:  # something was dropped, so the test exercised capacity
        assert sum(len(r) for r in routes) < S


@pytest.mark.parametrize("drop", [True, False])
def test_top2_matches_loops(drop):
    S, E = 12, 4
    logits = _logits(S, E, seed=1).requires_grad_()
    l_aux, combine, dispatch, counts = top2gating(logits, 1.0, 0, drop_tokens=drop, top2_2nd_expert_sampling=False)
    ref_logits = logits.detach().clone().requires_grad_()
    routes, choices = ref_routes(ref_logits, 2, capacity(S, E, 2.0, 0) if drop else None)
    want_l = ref_l_aux(ref_logits, choices, 2)
    assert counts.tolist() == ref_counts(choices, E)
    _check_slots(combine, dispatch, combine.shape[2])
    want_w = _dense_combine(routes, S, E)
    torch.testing.assert_close(combine.sum(dim=2), want_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(l_aux, want_l, rtol=0, atol=1e-6)
    probe = torch.randn(S, E, generator=torch.Generator().manual_seed(6))
    (combine.sum(dim=2) * probe).sum().add(l_aux).backward()
    (want_w * probe).sum().add(want_l).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-6)
    if drop:
        assert sum(len(r) for r in routes) < 2 * S
    else:
        assert all(len(r) == 2 for r in routes)


@pytest.mark.parametrize("drop", [True, False])
def test_topk_matches_loops(drop):
    S, E, k = 16, 6, 3
    logits = _logits(S, E, seed=2).requires_grad_()
    l_aux, combine, dispatch, counts = topkgating(logits, k, 0.5, 0, drop_tokens=drop)
    ref_logits = logits.detach().clone().requires_grad_()
    routes, choices = ref_routes(ref_logits, k, capacity(S, E, 0.5 * k, 0) if drop else None)
    assert counts.tolist() == ref_counts(choices, E)
    _check_slots(combine, dispatch, combine.shape[2])
    want_w = _dense_combine(routes, S, E)
    torch.testing.assert_close(combine.sum(dim=2), want_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(l_aux, ref_l_aux(ref_logits, choices, k), rtol=0, atol=1e-6)
    if drop:
        assert sum(len(r) for r in routes) < k * S


def test_topk_position_policy_keeps_first_tokens():
    S, E, k = 16, 4, 3
    logits = _logits(S, E, seed=3)
    _, _, dispatch, _ = topkgating(logits, k, 0.5, 0, drop_policy="position")
    cap = capacity(S, E, 0.5 * k, 0)
    routed = torch.zeros(S, E, dtype=torch.bool).scatter_(1, torch.topk(logits, k, dim=1).indices, True)
    for e in range(E):
        first = [s for s in range(S) if routed[s, e]][:cap]
        assert [s for s in range(S) if dispatch[s, e].any()] == first
    with pytest.raises(ValueError, match="drop_policy"):
        topkgating(logits, k, 1.0, 0, drop_policy="random")


def test_used_token_masks_padding():
    logits = _logits(8, 4, seed=4)
    used = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1.0])
    _, combine, _, counts = top1gating(logits, 2.0, 0, used_token=used, use_rts=False)
    assert int(counts.sum()) == 6
    assert combine[2].abs().sum() == 0 and combine[4].abs().sum() == 0


def test_min_capacity_guard():
    with pytest.raises(ValueError, match="min_capacity"):
        top1gating(_logits(3, 4), 1.0, 4)


def test_rts_keeps_capacity_and_chooses_uniformly():
    """All tokens pick expert 0: RTS keeps exactly `cap` of them, each about equally often."""
    S, E, cap_factor = 8, 4, 1.0
    logits = torch.zeros(S, E)
    logits[:, 0] = 5.0
    cap = capacity(S, E, cap_factor, 0)
    hits = torch.zeros(S)
    torch.manual_seed(0)
    trials = 400
    for _ in range(trials):
        _, _, dispatch, _ = top1gating(logits, cap_factor, 0, use_rts=True)
        kept = dispatch[:, 0].any(dim=1)
        assert int(kept.sum()) == cap and not dispatch[:, 1:].any()
        hits += kept.float()
    assert torch.all((hits / trials - cap / S).abs() < 0.1), hits / trials
    _, _, dispatch, _ = top1gating(logits, cap_factor, 0, use_rts=False)
    assert dispatch[:, 0].any(dim=1).tolist() == [True] * cap + [False] * (S - cap)


def test_rsample_follows_softmax_and_weights_stay_clean():
    """Gumbel-max: argmax(logits + Gumbel) picks expert e with probability softmax(logits)[e]."""
    S = 4000
    row = torch.tensor([1.0, 0.0, -1.0])
    logits = row.repeat(S, 1)
    torch.manual_seed(1)
    _, combine, _, counts = top1gating(logits, 1.0, 0, noisy_gate_policy="RSample", drop_tokens=False)
    torch.testing.assert_close(counts.float() / S, torch.softmax(row, 0), rtol=0, atol=0.03)
    weights = combine.sum(dim=(1, 2))
    chosen = combine.sum(dim=2).argmax(dim=1)
    torch.testing.assert_close(weights, torch.softmax(row, 0)[chosen])


def test_second_expert_sampling():
    S = 4000
    row = torch.tensor([2.0, 0.0, -1.0])
    torch.manual_seed(2)
    _, _, _, counts = top2gating(row.repeat(S, 1), 1.0, 0, drop_tokens=False)
    assert counts[0] == S  # the first choice is never sampled
    others = torch.softmax(row[1:], 0)
    torch.testing.assert_close(counts[1:].float() / S, others, rtol=0, atol=0.03)
    # without sampling the second choice is the second-best gate, always
    _, _, _, counts = top2gating(row.repeat(8, 1), 1.0, 0, drop_tokens=False, top2_2nd_expert_sampling=False)
    assert counts.tolist() == [8, 8, 0]


def test_jitter_only_in_training():
    torch.manual_seed(3)
    gate = TopKGate(6, 4, k=1, min_capacity=0, noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(10, 6)
    clean = top1gating(x @ gate.wg.weight.t(), 1.0, 0, use_rts=False)[1]
    gate.eval()
    assert torch.equal(gate(x)[1], clean)
    gate.train()
    seen = []
    for _ in range(5):
        seen.append(gate(x)[1])
    assert all(not torch.equal(s, clean) for s in seen)  # the noise moves every forward's weights
    # the jitter is multiplicative within 1%: the gate weights move by well under 10%
    for s in seen:
        assert (s.sum(dim=2) - clean.sum(dim=2)).abs().max() < 0.1


def test_gate_computes_in_fp32():
    gate = TopKGate(6, 4, k=2, min_capacity=0, top2_2nd_expert_sampling=False).to(torch.bfloat16)
    l_aux, combine, _, _ = gate(torch.randn(8, 6).to(torch.bfloat16))
    assert l_aux.dtype == torch.float32 and combine.dtype == torch.float32
    assert gate.wg.bias is None


def _moe(k, drop, E=4, M=6, residual=False):
    torch.manual_seed(0)
    layer = MoE(
        M,
        nn.Sequential(nn.Linear(M, 5), nn.Tanh(), nn.Linear(5, M)),
        num_experts=E,
        k=k,
        min_capacity=0,
        drop_tokens=drop,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        use_residual=residual,
    )
    with torch.no_grad():  # distinct experts (DeepSpeed starts them as equal copies)
        for j, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + j)) * 0.5)
    return layer


@pytest.mark.parametrize("k,drop", [(1, True), (1, False), (2, True), (2, False), (3, True)])
def test_layer_matches_dense_loops(k, drop):
    layer = _moe(k, drop)
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(1))
    out, l_aux, counts = layer(x)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    wg = layer.deepspeed_moe.gate.wg.weight
    E, S = 4, 14
    cap = capacity(S, E, 1.0 * k, 0) if drop else None
    want, want_l, want_counts = ref_moe_forward(x.reshape(-1, 6), wg, experts, k, cap)
    torch.testing.assert_close(out.reshape(-1, 6), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(l_aux, want_l, rtol=0, atol=1e-6)
    assert counts.tolist() == want_counts
    params = list(layer.parameters())
    got = torch.autograd.grad((out.pow(2).sum() + l_aux), params)
    ref = torch.autograd.grad((want.pow(2).sum() + want_l), params, allow_unused=True)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r, rtol=0, atol=1e-5)


def test_residual_moe_mixes_dense_path():
    layer = _moe(1, True, residual=True)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    out, _, _ = layer(x)
    moe_out = layer.deepspeed_moe(x)
    coef = torch.softmax(layer.coefficient(x), dim=-1)
    torch.testing.assert_close(out, moe_out * coef[:, :1] + layer.mlp(x) * coef[:, 1:])
    assert not any(moe_utils.is_moe_param(p) for p in layer.mlp.parameters())


def test_expert_registry_and_param_groups():
    layer = _moe(1, True)
    experts = list(layer.deepspeed_moe.experts.parameters())
    assert all(moe_utils.is_moe_param(p) for p in experts)
    assert not moe_utils.is_moe_param(layer.deepspeed_moe.gate.wg.weight)
    clone = copy.deepcopy(layer)
    assert sum(moe_utils.is_moe_param(p) for p in clone.parameters()) == len(experts)
    assert moe_utils.has_moe_layers(nn.Sequential(layer)) == (True, 4)
    assert moe_utils.has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    groups = moe_utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(layer.parameters()), "name": "all", "lr": 0.1}, max_group_size=40
    )
    assert groups[0]["name"] == "all" and groups[0]["params"] == [layer.deepspeed_moe.gate.wg.weight]
    moe_groups = groups[1:]
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.1 for g in moe_groups)
    assert [p for g in moe_groups for p in g["params"]] == experts
    assert all(sum(p.numel() for p in g["params"]) <= 40 or len(g["params"]) == 1 for g in moe_groups)
    shared, expert = moe_utils.split_params_into_shared_and_expert_params(list(layer.parameters()))
    assert expert == experts and shared == [layer.deepspeed_moe.gate.wg.weight]
    configured = moe_utils.configure_moe_param_groups(list(layer.parameters()))
    assert configured[0]["name"] == "dense-params" and configured[1]["moe"]


def test_deepspeed_tagged_params_count_as_experts():
    p = nn.Parameter(torch.zeros(2))
    p.allreduce, p.group_name = False, "ep_size_2"
    assert moe_utils.is_moe_param(p)
    groups = moe_utils.split_params_into_different_moe_groups_for_optimizer([{"params": [p], "name": "x"}])
    assert groups[1]["name"] == "ep_size_2"


def test_layer_errors():
    with pytest.raises(ValueError, match="divisible"):
        MoE(4, nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(4, nn.Linear(4, 4), num_experts=2, noisy_gate_policy="Gaussian")
    unbound = MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=2, min_capacity=0)
    with pytest.raises(RuntimeError, match="zerospeed.initialize"):
        unbound(torch.randn(4, 4))


def test_dropless_packing_on_one_rank():
    """Note [dropless exchange] with one rank: the packed, per-expert computation equals the experts on
    the padded buffer wherever a slot is used, and zeros elsewhere."""
    from zerospeed import comm
    from zerospeed.moe.dropless import run_dropless

    layer = _moe(1, False)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    slots = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(3))
    counts = [3, 0, 2, 1]
    out = run_dropless(slots, counts, experts, comm.SELF, 1, lambda fn, x: fn(x))
    for e, n in enumerate(counts):
        torch.testing.assert_close(out[e, :n], experts[e](slots[e, :n]))
        assert not out[e, n:].any()
