"""Tensor-parallel checkpoint reslicing (zerospeed/checkpoint/tensor_parallel.py), without processes:
which tp ranks write a parameter, local <-> canonical shapes, assembling a full tensor from tp pieces and
cutting it to another tp degree (fused, GQA-replicated, uneven-vocabulary, row and Conv1D-transposed
layouts), packing a flat entry, and the errors a reader gives for a checkpoint it cannot resolve."""

from __future__ import annotations

import pytest
import torch

from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.layout import EntryLayout, RankFile
from zerospeed.checkpoint.module_state import SavedModule, local_module_state
from zerospeed.checkpoint.naming import is_model_states_name, model_states_name, optim_states_name
from zerospeed.checkpoint.tensor_parallel import (
    TPLayout,
    assemble_full,
    canonical_shape,
    is_identity,
    layout_problem,
    layouts_from_json,
    layouts_to_json,
    local_shape,
    pack_pieces,
    reslice,
    writer_ranks,
    writes,
)
from zerospeed.checkpoint.universal import FP32, load_universal
from zerospeed.parallel.tensor.partition import (
    column_spec,
    fused_spec,
    head_layout,
    heads_spec,
    row_spec,
    take,
    vocab_spec,
)
from zerospeed.zero.shards import Piece

D, HEADS, KV, HD = 16, 4, 2, 4  # width, query heads, kv heads, head size


def fused(tp):  # GPT-2's c_attn as AutoTP splits it: [q | k | v] rows, by whole heads
    return TPLayout(tuple(fused_spec([D, D, D], tp, r, unit=HD) for r in range(tp)), transposed=True)


def kv(tp):  # a GQA k_proj: 2 kv heads; at tp 4 each is held by two ranks
    return TPLayout(tuple(heads_spec(head_layout(HEADS, KV, tp, r), HD, KV, kv=True) for r in range(tp)))


def vocab(tp, v=37):
    return TPLayout(tuple(vocab_spec(v, tp, r) for r in range(tp)))


def row(tp, n=4 * D):
    return TPLayout(tuple(row_spec(n, tp, r) for r in range(tp)))


CASES = {
    "fused_conv1d": (fused, [D, 3 * D]),
    "gqa_kv": (kv, [KV * HD, D]),
    "vocab": (vocab, [37, D]),
    "row": (row, [D, 4 * D]),
}


def test_writer_ranks_save_each_distinct_piece_once():
    assert writer_ranks(None) == [0] and writes(None, 0) and not writes(None, 1)
    assert writer_ranks(kv(4)) == [0, 2]  # ranks 1 and 3 hold copies of ranks 0 and 2's kv head
    assert [s.replicas for s in kv(4).specs] == [2, 2, 2, 2]
    assert writer_ranks(kv(2)) == [0, 1] and writer_ranks(fused(4)) == [0, 1, 2, 3]


def test_shapes_local_and_canonical():
    # Conv1D c_attn [in, out] = [16, 48]; the tp-2 Linear slice is [24, 16]
    assert local_shape([D, 3 * D], fused(2), 1) == [3 * D // 2, D]
    assert canonical_shape([3 * D // 2, D], fused(2), 1) == [D, 3 * D]
    assert local_shape([37, D], vocab(2), 0) == [19, D] and local_shape([37, D], vocab(2), 1) == [18, D]
    assert local_shape([D, 4 * D], row(4), 3) == [D, D]
    assert local_shape([5, 7], None, 3) == [5, 7]
    with pytest.raises(ValueError, match="does not have 48 entries along dim 0"):
        local_shape([3 * D, D], fused(2), 0)  # not transposed back: the rows are the wrong dim


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("saved_tp,loaded_tp", [(2, 4), (4, 2), (2, 1), (1, 4)])
def test_reslice_from_one_tp_degree_to_another(case, saved_tp, loaded_tp):
    make, shape = CASES[case]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    saved = make(saved_tp) if saved_tp > 1 else None
    loaded = make(loaded_tp) if loaded_tp > 1 else None
    pieces = {r: reslice(full, saved, r) for r in writer_ranks(saved)}
    for r, piece in pieces.items():
        assert list(piece.shape) == local_shape(shape, saved, r)
    rebuilt = assemble_full(pieces, saved)
    assert torch.equal(rebuilt, full)
    for r in range(loaded_tp):
        expect = full if loaded is None else take(full.t() if loaded.transposed else full, loaded.specs[r])
        assert torch.equal(reslice(rebuilt, loaded, r), expect)


def test_assemble_full_names_missing_pieces():
    full = torch.randn(KV * HD, D)
    with pytest.raises(ValueError, match=r"tp ranks \[2\] are missing"):
        assemble_full({0: reslice(full, kv(4), 0)}, kv(4))


def test_pack_pieces_keeps_only_this_ranks_pieces():
    flat = torch.arange(10.0)
    pieces = [Piece("a", 0, 0, 4), Piece("ln", 0, 4, 3), Piece("b", 2, 7, 3)]
    same, same_pieces = pack_pieces(flat, pieces, {"a", "ln", "b"})
    assert same is flat and same_pieces == pieces
    packed, moved = pack_pieces(flat, pieces, {"a", "b"})
    assert packed.tolist() == [0, 1, 2, 3, 7, 8, 9]
    assert moved == [Piece("a", 0, 0, 4), Piece("b", 2, 4, 3)]
    empty, none = pack_pieces(flat, pieces, set())
    assert empty.numel() == 0 and none == []


def test_layouts_json_round_trip_and_identity():
    layouts = {"w": fused(4), "k": kv(4), "e": vocab(2)}
    assert layouts_from_json(layouts_to_json(layouts)) == layouts
    assert layouts_from_json(None) == {}
    assert is_identity(TPLayout((column_spec(8, 1, 0),)))
    assert not is_identity(TPLayout((column_spec(8, 1, 0),), transposed=True)) and not is_identity(kv(2))


def test_layout_problem_names_the_parameter():
    assert layout_problem("k", [KV * HD, D], kv(4), 4) is None
    msg = layout_problem("h.0.attn.c_attn.weight", [D, 2 * D], fused(2), 2)
    assert "'h.0.attn.c_attn.weight'" in msg and "48 entries along dim 0" in msg
    assert "2 shard layouts for a tensor-parallel group of 4" in layout_problem("k", [KV * HD, D], kv(2), 4)


def test_names():
    assert model_states_name(3) == "mp_rank_03_model_states.pt"
    assert optim_states_name(1, 2) == "zero_pp_rank_1_mp_rank_02_optim_states.pt"
    assert is_model_states_name("mp_rank_01_model_states.pt")
    assert not is_model_states_name("layer_0_expert_1_mp_rank_00_model_states.pt")
    assert RankFile.from_json(RankFile(1, "f", (), tp_rank=2).to_json()).tp_rank == 2
    assert "tp_rank" not in RankFile(1, "f", ()).to_json()  # a plain checkpoint's partition is unchanged


def _tp_checkpoint(tmp_path, *, drop_piece: bool = False):
    """A hand-made tp-2 checkpoint of one vocab-sharded weight "e" [37, 4] and one replicated "ln" [4]."""
    full, ln = torch.randn(37, 4), torch.randn(4)
    layout = vocab(2)
    manifest = {
        "parameters": {
            "e": {"shape": [37, 4], "dtype": "float32", "trainable": True},
            "ln": {"shape": [4], "dtype": "float32", "trainable": True},
        },
        "tied": {},
        "parallel_layout": {"tensor_parallel": 2, "shard_specs": layouts_to_json({"e": layout})},
    }
    partition = []
    for r in writer_ranks(layout):
        local = reslice(full, layout, r).reshape(-1)
        masters = [local] + ([ln] if r == 0 else [])
        pieces = [Piece("e", 0, 0, local.numel())]
        if drop_piece and r == 1:
            pieces = [Piece("e", 0, 0, local.numel() - 4)]
        if r == 0:
            pieces.append(Piece("ln", 0, local.numel(), 4))
        master = torch.cat(masters)
        torch.save(
            {"entries": [{"master": master, "state": {"exp_avg": 2 * master, "step": torch.tensor(3.0)}}]},
            tmp_path / optim_states_name(0, r),
        )
        entry = EntryLayout(0, master.numel(), tuple(pieces), ("exp_avg",), ("step",))
        partition.append(RankFile(0, optim_states_name(0, r), (entry,), r).to_json())
        module = {"e": reslice(full, layout, r), **({"ln": ln} if r == 0 else {})}
        torch.save({"module": {} if drop_piece and r == 1 else module}, tmp_path / model_states_name(r))
    manifest["partition"] = partition
    return manifest, full, ln


def test_universal_form_of_a_tp_checkpoint(tmp_path):
    manifest, full, ln = _tp_checkpoint(tmp_path)
    uni = load_universal(tmp_path, manifest)
    assert torch.equal(uni.tensors["e"][FP32], full) and torch.equal(uni.tensors["e"]["exp_avg"], 2 * full)
    assert torch.equal(uni.tensors["ln"][FP32], ln) and float(uni.scalars["e"]["step"]) == 3.0
    saved = SavedModule(tmp_path, manifest, torch.load(tmp_path / model_states_name(0)))
    state = local_module_state(saved, layouts={"e": vocab(4)}, tp_rank=3, tp=4, tied={}, skip=set())
    assert torch.equal(state["e"], take(full, vocab_spec(37, 4, 3))) and torch.equal(state["ln"], ln)


def test_incomplete_tp_checkpoint_names_the_file_and_parameter(tmp_path):
    manifest, *_ = _tp_checkpoint(tmp_path, drop_piece=True)
    with pytest.raises(CheckpointError, match=r"tp rank 1's piece of parameter 'e'.*zero_pp_rank_\*_mp_rank_01"):
        load_universal(tmp_path, manifest)
    saved = SavedModule(tmp_path, manifest, torch.load(tmp_path / model_states_name(0)))
    with pytest.raises(CheckpointError, match=r"mp_rank_01_model_states.pt lacks tp rank 1's piece of 'e'.*save it"):
        saved.full("e")


def test_a_layout_that_cannot_cut_the_saved_tensor_is_a_clear_error(tmp_path):
    manifest, *_ = _tp_checkpoint(tmp_path)
    saved = SavedModule(tmp_path, manifest, torch.load(tmp_path / model_states_name(0)))
    with pytest.raises(CheckpointError, match=r"parameter 'e'.*40 entries along dim 0.*partition_config"):
        local_module_state(saved, layouts={"e": vocab(2, v=40)}, tp_rank=0, tp=2, tied={}, skip=set())
