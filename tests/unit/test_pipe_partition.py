"""Layer partitioning (pure) and the message layout codec of the stage transport."""

from __future__ import annotations

import pytest
import torch

from zerospeed.parallel.pipeline.partition import partition, partition_balanced, partition_by_type, partition_uniform
from zerospeed.parallel.pipeline.transport import META_LEN, MessageMeta, TensorMeta, decode, describe, encode
from zerospeed.utils.errors import ConfigError


def test_uniform_gives_the_remainder_to_the_first_parts():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]  # 3 + 3 + 2 + 2
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]
    assert partition_uniform(7, 1) == [0, 7]


def test_balanced_splits_evenly():
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]  # 4 | 4
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]  # 5 | 5
    assert partition_balanced([2, 2, 2, 2, 2, 2], 3) == [0, 2, 4, 6]
    # 3+3 | 7 | 1+1: the 7 alone bounds the heaviest part
    assert partition_balanced([3, 3, 7, 1, 1], 3) == [0, 2, 3, 5]


def test_by_type_spreads_matching_layers():
    names = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Head"]
    assert partition_by_type(names, "block", 2) == [0, 3, 7]  # blocks 1-2 | blocks 3-4 + norm + head
    assert partition_by_type(names, "^Block$", 4) == [0, 2, 3, 4, 7]


def test_dispatch_and_parameters_alias_best():
    names, counts = ["A", "B", "C"], [1, 1, 8]
    assert partition("uniform", class_names=names, param_counts=counts, num_parts=2) == [0, 2, 3]
    assert partition("parameters", class_names=names, param_counts=counts, num_parts=2) == [0, 2, 3]
    assert partition("best", class_names=names, param_counts=[8, 1, 1], num_parts=2) == [0, 1, 3]
    assert partition("type:[BC]", class_names=names, param_counts=counts, num_parts=2) == [0, 2, 3]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: partition("uniform", class_names=["A"] * 2, param_counts=[1, 1], num_parts=3),
            "cannot split 2 layers into 3 pipeline parts",
        ),
        (
            lambda: partition("parameters", class_names=["A"], param_counts=[1], num_parts=2),
            "cannot split 1 layers into 2 pipeline parts",
        ),
        (lambda: partition_by_type(["A", "Block"], "block", 2), "'type:block': 1 layer(s) match"),
        (
            lambda: partition("greedy", class_names=["A"], param_counts=[1], num_parts=1),
            "partition_method='greedy': unknown method",
        ),
    ],
)
def test_partition_errors(call, message):
    with pytest.raises(ConfigError) as err:
        call()
    assert message in str(err.value)


def test_message_layout_round_trip():
    x = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    meta = describe((x, mask), "test")
    assert meta == MessageMeta(
        True, (TensorMeta(torch.float32, True, (2, 3)), TensorMeta(torch.bool, False, (2, 3, 4)))
    )
    buf = encode(meta)
    assert buf.shape == (META_LEN,) and buf[:8].tolist() == [2, 1, 0, 1, 2, 2, 3, 9]
    assert decode(buf) == meta
    single = describe(torch.zeros(5, dtype=torch.bfloat16), "test")
    assert decode(encode(single)) == MessageMeta(False, (TensorMeta(torch.bfloat16, False, (5,)),))


def test_message_layout_errors():
    with pytest.raises(TypeError) as err:
        describe((torch.zeros(1), 3), "stage output")
    assert "stage output: pipeline messages must be tensors or tuples of tensors; item 1 is int" in str(err.value)
    with pytest.raises(TypeError) as err:
        encode(describe(torch.zeros(1, dtype=torch.complex64), "x"))
    assert "cannot carry torch.complex64" in str(err.value)
    with pytest.raises(ValueError) as err:
        encode(describe(tuple(torch.zeros(1, 1, 1, 1) for _ in range(20)), "x"))
    assert "more than 96" in str(err.value)
