"""The block-sparse kernels equal dense attention with the layout expanded to a token mask.

The reference is plain PyTorch written here: softmax(Q K^T / sqrt(d) + mask) V, with the layout,
key-padding mask and attention mask expanded to one [B, H, L, L] additive mask. Outputs and the
gradients of q, k and v must agree to 1e-6 in fp32. A dispatch-mode census checks that no op of the
gather path (forward or backward) makes a tensor that grows with L^2.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerospeed.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BlockSparsePlan,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
)
from zerospeed.ops.sparse_attention.block_sparse import ScoreBias, flex_block_mask, flex_block_sparse_attention

B, H, L, D, BLOCK = 2, 3, 64, 8, 8
TOL = {"atol": 1e-6, "rtol": 1e-6}  # fp32: a few ulps of |value| on top of the absolute bound


def dense_reference(q, k, v, layout, block, kp_bias=None, attn_bias=None, extra=None):
    """softmax(q k^T / sqrt(d) + mask) v, all terms additive [.., L, L]."""
    keep = layout.repeat_interleave(block, -2).repeat_interleave(block, -1).bool()  # [H, L, L]
    mask = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)[None]
    if kp_bias is not None:
        mask = mask + kp_bias[:, None, None, :]
    if attn_bias is not None:
        mask = mask + attn_bias
    if extra is not None:
        mask = mask + extra
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(scores, dim=-1) @ v


def inputs(seed=0, shape=(B, H, L, D)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3)]


def grads(out, tensors, seed=1):
    weight = 0.5 * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors, retain_graph=True)


def assert_matches(out, ref, tensors):
    """fp32 output and gradients within 1e-6 (+ 1e-6 relative) of the reference (the reference's own rounding
    included)."""
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(grads(out, tensors), grads(ref, tensors)):
        torch.testing.assert_close(got, want, **TOL)


def _configs():
    random.seed(0)
    return {
        "dense": DenseSparsityConfig(H, block=BLOCK),
        "fixed": FixedSparsityConfig(H, block=BLOCK, num_local_blocks=2),
        "fixed_uni": FixedSparsityConfig(H, block=BLOCK, num_local_blocks=4, attention="unidirectional"),
        "fixed_per_head": FixedSparsityConfig(
            H,
            block=BLOCK,
            num_local_blocks=4,
            num_global_blocks=2,
            different_layout_per_head=True,
            num_different_global_patterns=2,
        ),
        "variable": VariableSparsityConfig(
            H,
            block=BLOCK,
            num_random_blocks=1,
            local_window_blocks=[1, 3],
            global_block_indices=[2],
            horizontal_global_attention=True,
            different_layout_per_head=True,
        ),
        "bigbird": BigBirdSparsityConfig(H, block=BLOCK, num_random_blocks=2),
        "bigbird_uni": BigBirdSparsityConfig(H, block=BLOCK, num_random_blocks=1, attention="unidirectional"),
        "bslongformer": BSLongformerSparsityConfig(H, block=BLOCK, global_block_indices=[0, 5]),
        "local_uni": LocalSlidingWindowSparsityConfig(H, block=BLOCK),
    }


CONFIGS = _configs()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("chunk_elements", [200, 2**21])  # many small chunks / one chunk
def test_gather_path_equals_dense_attention(name, chunk_elements):
    layout = CONFIGS[name].make_layout(L)
    q, k, v = inputs()
    out = block_sparse_attention(q, k, v, layout, BLOCK, chunk_elements=chunk_elements)
    assert_matches(out, dense_reference(q, k, v, layout, BLOCK), (q, k, v))


def _padding(mode):
    """Batch 1 pads its last 11 tokens; 'add' as BERT's extended mask, 'mul' as a 0/1 keep mask."""
    keep = torch.ones(B, L)
    keep[1, -11:] = 0
    bias = torch.zeros(B, L).masked_fill(keep == 0, -10000.0 if mode == "add" else -math.inf)
    return (bias if mode == "add" else keep), bias


def _attn_mask(mode):
    """A random keep pattern (diagonal always kept), as 0/1 ('mul') or additive values ('add')."""
    gen = torch.Generator().manual_seed(3)
    keep = ((torch.rand(L, L, generator=gen) > 0.3) | torch.eye(L, dtype=torch.bool)).float()
    if mode == "mul":
        return keep, torch.zeros(L, L).masked_fill(keep == 0, -math.inf)
    values = torch.randn(L, L, generator=gen)
    return values, values


@pytest.mark.parametrize("name", ["fixed", "fixed_uni", "bigbird", "variable"])
@pytest.mark.parametrize("kp_mode, attn_mode", [("add", "mul"), ("mul", "add"), ("add", "add")])
def test_masks_equal_dense_attention(name, kp_mode, attn_mode):
    q, k, v = inputs(seed=4)
    kp, kp_bias = _padding(kp_mode)
    attn, attn_bias = _attn_mask(attn_mode)
    module = SparseSelfAttention(
        CONFIGS[name], key_padding_mask_mode=kp_mode, attn_mask_mode=attn_mode, max_seq_length=L
    )
    layout = module.get_layout(L)  # random blocks: the module's own draw
    out = module(q, k, v, key_padding_mask=kp[:, None, None, :], attn_mask=attn)  # BERT's [B, 1, 1, L] form
    assert_matches(out, dense_reference(q, k, v, layout, BLOCK, kp_bias, attn_bias), (q, k, v))


def test_causal_mask_inside_blocks_equals_a_tril_attention_mask():
    q, k, v = inputs(seed=5)
    module = SparseSelfAttention(CONFIGS["bigbird_uni"], max_seq_length=L)
    layout = module.get_layout(L)
    tril = torch.ones(L, L).tril()
    ref = dense_reference(q, k, v, layout, BLOCK, attn_bias=torch.zeros(L, L).masked_fill(tril == 0, -math.inf))
    assert_matches(module(q, k, v, causal=True), ref, (q, k, v))
    assert_matches(module(q, k, v, attn_mask=tril), ref, (q, k, v))  # DeepSpeed's way: a 'mul' mask


def test_rpe_per_batch_and_head_and_4d_attention_mask():
    layout = CONFIGS["fixed_per_head"].make_layout(L)
    q, k, v = inputs(seed=6)
    rpe = torch.randn(B, H, L, L, generator=torch.Generator().manual_seed(16))  # seeded: not the global stream
    attn, attn_bias = _attn_mask("add")
    attn4 = attn.expand(B, 1, L, L)
    out = block_sparse_attention(q, k, v, layout, BLOCK, rpe=rpe, attn_mask=attn4, chunk_elements=300)
    assert_matches(out, dense_reference(q, k, v, layout, BLOCK, attn_bias=attn_bias, extra=rpe), (q, k, v))


def test_key_given_transposed_and_shared_layout_for_more_heads():
    module = SparseSelfAttention(FixedSparsityConfig(1, block=BLOCK, num_local_blocks=2), max_seq_length=L)
    q, k, v = inputs(seed=7)
    out = module(q, k.transpose(-1, -2), v)  # [B, H, D, L] keys, 3 heads for a 1-head layout
    layout = module.get_layout(L).expand(H, -1, -1)
    assert_matches(out, dense_reference(q, k, v, layout, BLOCK), (q, k, v))
    with pytest.raises(NotImplementedError, match="self-attention"):
        module(q, k, v[:, :, :BLOCK])


def test_rows_with_nothing_to_attend_give_zeros_and_finite_gradients():
    layout = CONFIGS["fixed"].make_layout(L).clone()
    layout[:, 2] = 0  # an empty block row
    q, k, v = inputs(seed=8)
    kp = torch.ones(B, L)
    kp[0] = 0  # batch 0: every key masked
    out = block_sparse_attention(q, k, v, layout, BLOCK, key_padding_mask=kp, key_padding_mask_mode="mul")
    assert torch.all(out[0] == 0) and torch.all(out[:, :, 2 * BLOCK : 3 * BLOCK] == 0)
    ref = dense_reference(q[1:], k[1:], v[1:], layout, BLOCK)
    rows = torch.ones(L, dtype=torch.bool)
    rows[2 * BLOCK : 3 * BLOCK] = False
    torch.testing.assert_close(out[1][:, rows], ref[0][:, rows], **TOL)
    assert all(torch.isfinite(g).all() for g in grads(out, (q, k, v)))


def test_low_precision_is_close_to_fp32():
    layout = CONFIGS["bigbird"].make_layout(L)
    q, k, v = inputs(seed=9)
    ref = block_sparse_attention(q, k, v, layout, BLOCK)
    low = block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, BLOCK)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


def test_bad_arguments():
    layout = CONFIGS["fixed"].make_layout(L)
    q, k, v = inputs()
    with pytest.raises(ValueError, match="multiple of the block"):
        block_sparse_attention(q[:, :, :60], k[:, :, :60], v[:, :, :60], layout, BLOCK)
    with pytest.raises(ValueError, match="kernel"):
        block_sparse_attention(q, k, v, layout, BLOCK, kernel="triton")
    with pytest.raises(ValueError, match="key_padding_mask"):
        block_sparse_attention(q, k, v, layout, BLOCK, key_padding_mask=torch.zeros(B, L + 1))
    with pytest.raises(ValueError, match="different head layouts"):
        block_sparse_attention(q[:, :2], k[:, :2], v[:, :2], CONFIGS["fixed_per_head"].make_layout(L), BLOCK)


# --- flex_attention path (its eager reference on CPU: no backward there) ---------------------------------


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block, seq_len", [(16, 256), (32, 96)])  # coarsened to 128-token tiles / own tiles
def test_flex_path_forward_equals_dense_attention(block, seq_len):
    random.seed(1)
    config = BigBirdSparsityConfig(
        H, block=block, num_random_blocks=1, different_layout_per_head=True, attention="unidirectional"
    )
    layout = config.make_layout(seq_len)
    with torch.no_grad():
        q, k, v = inputs(seed=10, shape=(B, H, seq_len, D))
        kp = torch.zeros(B, seq_len)
        kp[1, -7:] = -10000.0
        bias = ScoreBias(B, H, seq_len, block, key_padding_mask=kp, causal=True)
        out = flex_block_sparse_attention(q, k, v, BlockSparsePlan(layout, block), D**-0.5, bias, compiled=False)
        causal = torch.zeros(seq_len, seq_len).masked_fill(torch.ones(seq_len, seq_len).tril() == 0, -math.inf)
        ref = dense_reference(q, k, v, layout, block, kp, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_flex_block_mask_covers_exactly_the_layout():
    layout = CONFIGS["variable"].make_layout(128)  # 16 blocks of 8 -> one 128-token tile per row
    mask = flex_block_mask(BlockSparsePlan(layout, BLOCK))
    dense = mask.to_dense()  # [1, H, tiles, tiles]
    assert dense.shape == (1, H, 1, 1) and bool(dense.all())


def test_flex_path_refuses_backward_on_cpu():
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match="gather"):
        block_sparse_attention(q, k, v, CONFIGS["fixed"].make_layout(L), BLOCK, kernel="flex")


# --- memory: nothing grows with L^2 --------------------------------------------------------------------


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor(seq_len: int, chunk_elements: int) -> int:
    random.seed(0)
    layout = BigBirdSparsityConfig(1, block=32, num_random_blocks=1).make_layout(seq_len)
    q, k, v = inputs(shape=(1, 1, seq_len, 16))
    with _LargestTensor() as census:
        out = block_sparse_attention(q, k, v, layout, 32, chunk_elements=chunk_elements)
        out.sum().backward()
    return census.largest


def test_no_tensor_grows_with_the_square_of_the_sequence():
    small, large = _largest_tensor(1024, 2**16), _largest_tensor(4096, 2**16)
    assert large < 4096 * 4096 // 64
    # BigBird's one global row holds every block (L x block scores); everything else is O(L x D).
    assert large <= 4 * small + 4096


def test_dense_layout_is_cut_into_row_chunks_too():
    # every row of a dense layout shares one set of key blocks: the group is split, never [L, L]
    seq_len = 1024
    layout = DenseSparsityConfig(1, block=32).make_layout(seq_len)
    q, k, v = inputs(shape=(1, 1, seq_len, 16))
    with _LargestTensor() as census:
        out = block_sparse_attention(q, k, v, layout, 32, chunk_elements=2**16)
        out.sum().backward()
    assert census.largest < seq_len * seq_len // 8
    torch.testing.assert_close(out, dense_reference(q, k, v, layout, 32), **TOL)
