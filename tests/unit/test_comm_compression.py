"""The 1-bit compression's pure parts, without processes: sign packing, padding, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from harness.onebit_reference import simulate_compressed_allreduce
from zerospeed.comm.compressed import compressed_allreduce, error_buffers, pack_signs, padded_size, unpack_signs


def test_sign_packing_is_lossless_and_maps_zero_to_plus_one():
    x = torch.randn(1024)
    x[::7] = 0.0
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 128
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), expected)
    # most significant bit first: + - - - - - - + is 0b10000001
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 2])).tolist() == [129]
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(5))


@pytest.mark.parametrize(
    "n,world,expected",
    [(10, 1, 16), (8, 1, 8), (10, 2, 16), (17, 4, 32), (1, 3, 72), (73, 3, 144), (64, 8, 64), (65, 8, 128)],
)
def test_padding_makes_whole_bytes_per_rank(n, world, expected):
    # a multiple of world * lcm(world, 8): every rank's chunk is a whole number of bytes
    assert padded_size(n, world) == expected
    assert (expected // world) % 8 == 0


def test_error_feedback_over_a_fixed_sequence_equals_the_hand_computation():
    """One rank: x = b + e; scale = ||x|| / sqrt(n); result = scale * sign(x) (the server re-compression of an
    already 1-bit tensor changes nothing); e = x - result. Three calls on the same b, written out."""
    b = [3.0, -1.0, 1.0, -3.0, 0.0, 2.0, -2.0, 1.0]
    worker, server = error_buffers(8, 1)
    e = [0.0] * 8
    for _ in range(3):
        x = [bi + ei for bi, ei in zip(b, e)]
        scale = math.sqrt(sum(v * v for v in x) / 8)
        result = [scale if v >= 0 else -scale for v in x]
        e = [v - r for v, r in zip(x, result)]
        got = compressed_allreduce(torch.tensor(b), worker, server)
        assert got.tolist() == pytest.approx(result, abs=1e-6)
        assert worker.tolist() == pytest.approx(e, abs=1e-6)
        assert server.abs().max() <= 1e-6
    # the first call, by hand: ||b||^2 = 29, scale = sqrt(29 / 8)
    first = compressed_allreduce(torch.tensor(b), *error_buffers(8, 1))
    assert first[0].item() == pytest.approx(math.sqrt(29 / 8)) and first[1].item() == pytest.approx(-math.sqrt(29 / 8))


def test_reference_simulation_of_two_ranks_by_hand():
    """The single-process reference the distributed tests use, on two ranks of 16 elements, by hand."""
    a, b = torch.full((16,), 2.0), torch.cat([torch.full((8,), -1.0), torch.full((8,), 3.0)])
    we = [torch.zeros(16), torch.zeros(16)]
    se = [torch.zeros(8), torch.zeros(8)]
    out = simulate_compressed_allreduce([a, b], we, se)
    # worker scales: 2 and sqrt((8 + 72) / 16) = sqrt(5); chunk 0 = (2 - sqrt 5) / 2 < 0, chunk 1 = (2 + sqrt 5) / 2
    s5 = math.sqrt(5)
    assert out[:8].tolist() == pytest.approx([(2 - s5) / 2] * 8)
    assert out[8:].tolist() == pytest.approx([(2 + s5) / 2] * 8)
    assert we[1][:8].tolist() == pytest.approx([-1 + s5] * 8)


def test_shape_mismatch_names_the_sizes():
    with pytest.raises(ValueError, match="worker error of 8"):
        compressed_allreduce(torch.ones(8), torch.zeros(16), torch.zeros(16))


@pytest.mark.parametrize(
    "path,cls",
    [("nccl", "NcclBackend"), ("mpi", "MpiBackend"), ("hccl", "HcclBackend"), ("compressed", "CompressedBackend")],
)
def test_deepspeed_backend_classes_reduce_in_place(path, cls):
    """DeepSpeed's `runtime.comm.<backend>` classes: `compressed_allreduce(buffer, we, se, local_rank)` writes
    the result into the buffer and returns it (one rank: the 1-bit compression of the buffer itself)."""
    import importlib

    backend_cls = getattr(importlib.import_module(f"zerospeed.runtime.comm.{path}"), cls)
    b = backend_cls()
    assert b.size == 1
    x = torch.tensor([3.0, -1.0, 1.0, -3.0, 0.0, 2.0, -2.0, 1.0])
    out = b.compressed_allreduce(x, *error_buffers(8, 1), 0)
    assert out is x and out[0].item() == pytest.approx(math.sqrt(29 / 8))
