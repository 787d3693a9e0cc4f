"""Flops profiler: exact analytic counts (2*m*n*k per matmul, 1 per bias/elementwise/activation,
5 per element for an affine norm, both attention matmuls + softmax), module attribution, report."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.profiling import FlopsProfiler, count_flops, get_model_profile, peak_flops_for
from zerospeed.profiling.report import format_profile, human, top_modules_by_depth
from zoo.models import GPT, GPTConfig, TinyMLP


def profile(model, *args):
    return get_model_profile(model, args=args, print_profile=False, as_string=False, warm_up=0)


def test_mlp_exact():
    B, d_in, h, d_out = 3, 16, 32, 8
    linear = lambda i, o: 2 * B * i * o + B * o  # matmul + bias add
    expected = linear(d_in, h) + B * h + linear(h, h) + B * h + linear(h, d_out)  # two ReLUs
    flops, macs, params = profile(TinyMLP(d_in, h, d_out, n_layers=2), torch.randn(B, d_in))
    assert flops == expected == 11_160
    assert macs == B * (d_in * h + h * h + h * d_out)
    assert params == (d_in + 1) * h + (h + 1) * h + (h + 1) * d_out


def gpt_forward_flops(B, T, D, H, V, L):
    """Analytic forward FLOPs of zoo.models.GPT (logits, no loss)."""
    N = B * T
    lin = lambda i, o, bias=True: 2 * N * i * o + (N * o if bias else 0)
    attn = 2 * (B * H * T * T * (D // H)) * 2 + B * H * T * T  # q k^T and p v, then softmax
    block = (
        5 * N * D
        + lin(D, 3 * D)
        + attn
        + lin(D, D)
        + N * D  # ln_1, qkv, sdpa, proj, residual
        + 5 * N * D
        + lin(D, 4 * D)
        + 4 * N * D
        + lin(4 * D, D)
        + N * D
    )  # ln_2, fc, gelu, proj, residual
    return N * D + L * block + 5 * N * D + lin(D, V, bias=False)  # wte + wpe, blocks, ln_f, tied head


@pytest.mark.parametrize("B,T,cfg", [(2, 16, GPTConfig()), (1, 8, GPTConfig(n_layer=3, n_head=4, n_embd=32))])
def test_gpt_forward_exact(B, T, cfg):
    flops, macs, _ = profile(GPT(cfg), torch.randint(0, cfg.vocab_size, (B, T)))
    D, H, V, L = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    assert flops == gpt_forward_flops(B, T, D, H, V, L)
    per_block = B * T * (D * 3 * D + D * D + D * 4 * D * 2) + B * H * T * T * (D // H) * 2
    assert macs == L * per_block + B * T * D * V


def test_gpt_2_16_literal():
    # the same count, written out once for the default config: 7,718,912 FLOPs
    assert gpt_forward_flops(2, 16, 64, 2, 256, 2) == 7_718_912


def test_conv_einsum_bmm_norms_activations_softmax_embedding():
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3)
    out = F.conv2d(x, w, torch.zeros(4))  # (2, 4, 6, 6); 27 MACs per output
    assert count_flops("conv2d", (x, w, torch.zeros(4)), {}, out) == (2 * 288 * 27 + 288, 288 * 27)
    wt = torch.randn(3, 5, 2, 2)
    out_t = F.conv_transpose2d(x, wt)  # every input element scatters into 5*2*2 outputs
    assert count_flops("conv_transpose2d", (x, wt), {}, out_t) == (2 * 384 * 20, 384 * 20)
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    assert count_flops("einsum", ("ij,jk->ik", a, b), {}, a @ b) == (48, 24)
    p, q = torch.randn(5, 2, 3), torch.randn(5, 3, 7)
    assert count_flops("bmm", (p, q), {}, torch.bmm(p, q)) == (2 * 5 * 2 * 7 * 3, 5 * 2 * 7 * 3)
    assert count_flops("addmm", (torch.zeros(4), a, b), {}, a @ b) == (48 + 8, 24)
    y = torch.randn(6, 10)
    assert count_flops("layer_norm", (y, (10,), torch.ones(10)), {}, y) == (300, 0)
    assert count_flops("layer_norm", (y, (10,)), {}, y) == (240, 0)
    assert count_flops("batch_norm", (y, None, None, torch.ones(10)), {}, y) == (300, 0)
    assert count_flops("gelu", (y,), {}, y) == (60, 0)
    assert count_flops("softmax", (y, -1), {}, y) == (60, 0)
    assert count_flops("embedding", (torch.tensor([1]), y), {}, y[:1]) == (0, 0)
    assert count_flops("view", (y,), {}, y) is None


def test_sdpa_counts_both_matmuls_and_softmax():
    q = torch.randn(2, 4, 5, 8)
    k = v = torch.randn(2, 4, 7, 8)
    out = F.scaled_dot_product_attention(q, k, v)
    macs = 2 * 4 * 5 * 7 * (8 + 8)
    assert count_flops("scaled_dot_product_attention", (q, k, v), {}, out) == (2 * macs + 2 * 4 * 5 * 7, macs)


class Twice(nn.Module):
    """Calls one child twice and does a matmul of its own: attribution must be inclusive."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.inner(self.inner(x)) @ torch.ones(4, 2)


def test_module_attribution_latency_and_report():
    model = Twice()
    prof = FlopsProfiler(model)
    prof.start_profile()
    assert prof.running
    model(torch.randn(3, 4))
    prof.stop_profile()
    stats = {s.name: s for s in prof.module_stats()}
    assert stats["inner"].flops == 2 * (2 * 3 * 4 * 4) and stats["inner"].calls == 2
    assert stats["(model)"].flops == stats["inner"].flops + 2 * 3 * 4 * 2 == prof.get_total_flops()
    assert stats["(model)"].latency >= stats["inner"].latency > 0
    assert [s.name for s in top_modules_by_depth(prof.module_stats(), 1)[1]] == ["inner"]
    text = format_profile(prof, peak_flops=1e12, step=3, batch_size=3, top_modules=1)
    assert "profile step:                  3" in text and "MFU (forward, peak 1.00 TFLOP/s)" in text
    assert "inner (Linear): 16 params" in text
    # after stop, calls no longer count
    model(torch.randn(3, 4))
    assert prof.get_total_flops() == stats["(model)"].flops


def test_get_model_profile_strings_file_and_errors(tmp_path):
    out = tmp_path / "profile.txt"
    flops, macs, params = get_model_profile(TinyMLP(), input_shape=(3, 16), output_file=str(out), warm_up=1)
    assert (flops, macs, params) == ("11.16 KFLOPs", "5.38 KMACs", "1.86 K")
    assert "per-module profile" in out.read_text()
    with pytest.raises(ValueError, match="give input_shape or args, not both"):
        get_model_profile(TinyMLP(), input_shape=(3, 16), args=(torch.randn(3, 16),))


def test_helpers():
    assert human(1_234_567, "FLOPs") == "1.23 MFLOPs"
    assert human(12) == "12"
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("Some CPU") is None


def test_zero3_sharded_model_counts_full_parameters():
    import zerospeed
    from zerospeed.estimate import census_of_module

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=GPT(GPTConfig()), config=cfg)
    assert sum(p.numel() for p in engine.module.parameters()) == 0  # released shards outside forward
    prof = FlopsProfiler(engine.module)
    prof.start_profile()
    engine(torch.randint(0, 256, (2, 16)))
    prof.stop_profile()
    assert prof.get_total_flops() == gpt_forward_flops(2, 16, 64, 2, 256, 2)
    assert prof.get_total_params() == census_of_module(engine.module).total_params == 120_576


def test_tp_size_counts_replicated_work_once_and_labels_per_rank():
    # A model without tensor-parallel layers is replicated on every tp rank: its model totals are one rank's.
    model = TinyMLP()
    prof = FlopsProfiler(model, tp_size=2)
    prof.start_profile()
    model(torch.randn(3, 16))
    prof.stop_profile()
    assert (
        prof.model_totals()
        == (prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params())
        == (11_160, 5_376, 1_864)
    )
    text = format_profile(prof, detailed=True)
    assert "tensor-parallel size:          2" in text and "forward FLOPs of model:        11.16 KFLOPs" in text
    assert "forward FLOPs per rank:        11.16 KFLOPs" in text and "inclusive of children, this rank" in text
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        FlopsProfiler(model, tp_size=0)
