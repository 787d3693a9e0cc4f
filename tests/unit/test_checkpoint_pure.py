"""Pure pieces of zerospeed.checkpoint: names, tags, coverage, sizes, shard plans, model mismatches,
layouts, the data-sampler resume position — exact values, no processes."""

from __future__ import annotations

import pytest
import torch

from zerospeed.checkpoint.export import parse_size, plan_shards, shard_name, split_aliases
from zerospeed.checkpoint.layout import EntryLayout, RankFile, entry_groups, split_state
from zerospeed.checkpoint.manifest import model_mismatches, param_specs, tied_aliases
from zerospeed.checkpoint.naming import CheckpointPaths, check_tag, default_tag, optim_states_name
from zerospeed.checkpoint.save import compact, compact_state_dict
from zerospeed.checkpoint.tags import tag_disagreement
from zerospeed.checkpoint.universal import uncovered
from zerospeed.data.loader import resume_position
from zerospeed.zero.shards import Piece


def test_deepspeed_file_names():
    assert optim_states_name(3) == "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    assert default_tag(120) == "global_step120"
    paths = CheckpointPaths(__import__("pathlib").Path("/ck"), "global_step7")
    assert str(paths.dir) == "/ck/global_step7" and str(paths.latest) == "/ck/latest"
    assert str(paths.staging) == "/ck/.global_step7.partial" and str(paths.previous) == "/ck/.global_step7.previous"


@pytest.mark.parametrize(
    "tag,why",
    [
        ("", "non-empty"),
        (None, "non-empty"),
        ("a/b", "path separators"),
        ("..", "path separators"),
        (".hidden", "must not start with '.'"),
        (" x", "whitespace"),
        ("x\n", "whitespace"),
    ],
)
def test_bad_tags_are_rejected_with_the_reason(tag, why):
    with pytest.raises(ValueError, match=why):
        check_tag(tag)


def test_tag_disagreement_lists_the_ranks_of_each_tag():
    assert tag_disagreement(["a", "a", "a"]) is None
    assert tag_disagreement(["a", "b", "a"]) == (
        "checkpoint tags differ across ranks: 'a' on ranks [0, 2]; 'b' on ranks [1]"
    )


def test_uncovered_ranges():
    assert uncovered([(0, 4), (4, 10)], 10) == []
    assert uncovered([(6, 10), (0, 3)], 10) == [(3, 6)]
    assert uncovered([(0, 5), (2, 4)], 8) == [(5, 8)]
    assert uncovered([], 3) == [(0, 3)]
    assert uncovered([(1, 2)], 4) == [(0, 1), (2, 4)]


def test_parse_size_uses_decimal_and_binary_units():
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("500MB") == 500_000_000
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("1.5kb") == 1500
    assert parse_size(" 10 KiB ") == 10240
    assert parse_size(123) == 123 and parse_size("77") == 77
    for bad in ("5 parsecs", "GB", "-1GB", 0, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_plan_shards_fills_greedily_and_isolates_oversized_tensors():
    sizes = [("a", 4), ("b", 4), ("c", 3), ("d", 12), ("e", 1)]
    # huggingface_hub's split_torch_state_dict_into_shards (DeepSpeed's converter) groups them so:
    # the oversized "d" gets a shard at once and "c" stays open for "e".
    assert plan_shards(sizes, 10) == [["a", "b"], ["d"], ["c", "e"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert plan_shards([], 10) == []
    assert shard_name("model", "safetensors", 0, 3) == "model-00001-of-00003.safetensors"


def test_split_aliases_keeps_the_first_name_of_shared_tensors():
    w = torch.ones(2, 2)
    sd = {
        "emb": w,
        "x": torch.zeros(3),
        "head": w,
        "head_view": w.view(2, 2),
        "empty": torch.zeros(0),
        "empty2": torch.zeros(0),
    }
    unique, aliases = split_aliases(sd)
    assert list(unique) == ["emb", "x", "empty", "empty2"]
    assert aliases == {"head": "emb", "head_view": "emb"}


def test_model_mismatches_name_the_parameters():
    saved = {"a": {"shape": [2, 3]}, "b": {"shape": [4]}, "old": {"shape": [1]}}
    current = {"a": {"shape": [2, 3]}, "b": {"shape": [5]}, "new": {"shape": [1]}}
    assert model_mismatches(saved, current, strict=True) == [
        "missing from the checkpoint: new",
        "in the checkpoint but not in the model: old",
        "shape mismatch: b (checkpoint [4], model [5])",
    ]
    assert model_mismatches(saved, current, strict=False) == ["shape mismatch: b (checkpoint [4], model [5])"]
    many = {f"p{i}": {"shape": [1]} for i in range(11)}
    assert model_mismatches({}, many, strict=True) == [
        "missing from the checkpoint: p0, p1, p2, p3, p4, p5, p6, p7 and 3 more"
    ]


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)


def test_param_specs_and_tied_aliases():
    m = _Tied()
    assert param_specs(m) == {
        "emb.weight": {"shape": [4, 3], "dtype": "float32", "trainable": True},
        "frozen": {"shape": [2], "dtype": "float32", "trainable": False},
    }
    assert tied_aliases(m) == {"head.weight": "emb.weight"}


def test_split_state_separates_elementwise_from_scalar_state():
    state = {
        "step": torch.tensor(3.0),
        "exp_avg": torch.zeros(6),
        "factored": torch.zeros(2),
        "k": 1.5,
        "matrix": torch.zeros(2, 3),
    }
    assert split_state(state, 6) == (["exp_avg", "matrix"], ["step", "factored", "k"])


def test_entry_groups_maps_masters_to_param_groups():
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    assert entry_groups(opt, [b, a, c]) == [1, 0, -1]
    assert entry_groups(None, [a, b]) == [-1, -1]


def test_layouts_round_trip_through_json():
    rf = RankFile(1, "f.pt", (EntryLayout(0, 12, (Piece("w", 4, 0, 8), Piece("b", 0, 8, 2)), ("exp_avg",), ("step",)),))
    assert RankFile.from_json(rf.to_json()) == rf
    assert rf.to_json()["entries"][0]["pieces"] == [["w", 4, 0, 8], ["b", 0, 8, 2]]


def test_compact_clones_only_views_of_larger_storage():
    flat = torch.arange(10.0)
    owned = torch.arange(4.0)
    assert compact(owned).untyped_storage().data_ptr() == owned.untyped_storage().data_ptr()
    view = flat[2:6]
    c = compact(view)
    assert torch.equal(c, view) and c.untyped_storage().nbytes() == 16
    sd = compact_state_dict({"a": flat[0:4].view(2, 2), "tied": flat[0:4].view(2, 2), "b": flat[4:6], "n": 3})
    assert sd["a"] is sd["tied"] and sd["b"].untyped_storage().nbytes() == 8 and sd["n"] == 3


def test_resume_position_converts_between_world_sizes():
    # 3 micro-batches of 2 on each of 2 ranks = the first 12 samples of the epoch's order
    assert resume_position(3, 2, 2, 2, 2) == (3, True)
    assert resume_position(3, 2, 2, 1, 4) == (3, True)  # 12 samples / (1 x 4)
    assert resume_position(3, 2, 2, 3, 4) == (1, True)  # 12 / 12
    assert resume_position(1, 2, 2, 3, 1) == (1, False)  # 4 samples: one batch of 3, one sample repeats
    assert resume_position(0, 2, 2, 5, 3) == (0, True)
