"""File-level pieces: atomic writes, the tag directory swap, the safetensors format, the resumable
training DataLoader — no processes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch as safetensors_torch
import torch

from zerospeed.checkpoint import safetensors_io
from zerospeed.checkpoint.atomic import sha256_file, swap_in_dir
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.export import clone_overlapping, export_state_dict, read_exported
from zerospeed.checkpoint.naming import CheckpointPaths
from zerospeed.checkpoint.safetensors_io import SafetensorsError, read_safetensors, write_safetensors
from zerospeed.checkpoint.tags import resolve_tag_dir
from zerospeed.data.loader import RepeatingLoader, ShardedDataLoader
from zerospeed.utils.files import atomic_write, atomic_write_text


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "latest"
    atomic_write_text(path, "old")

    def dies_half_way(f):
        f.write(b"ne")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(path, dies_half_way)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert sha256_file(path) == "11507a0e2f5e69d5dfa40a62a1bd7b6ee57e6bcd85c67c9b8431b36fff21c437"  # sha256(b"new")


def _tagdir(path, content):
    path.mkdir()
    (path / "f").write_text(content)


def test_swap_replaces_a_tag_and_every_interrupted_state_resolves_to_a_complete_copy(tmp_path):
    paths = CheckpointPaths(tmp_path, "t")
    _tagdir(paths.staging, "v1")
    swap_in_dir(paths.staging, paths.dir, paths.previous)
    assert (paths.dir / "f").read_text() == "v1" and not paths.previous.exists()
    _tagdir(paths.staging, "v2")
    swap_in_dir(paths.staging, paths.dir, paths.previous)
    assert (paths.dir / "f").read_text() == "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["t"]

    # killed between the two renames: only `.t.previous` is complete, and loading falls back to it
    paths.dir.rename(paths.previous)
    _tagdir(paths.staging, "v3")
    assert (resolve_tag_dir(paths) / "f").read_text() == "v2"
    # the next save of the tag must not delete that only copy before its own is in place
    swap_in_dir(paths.staging, paths.dir, paths.previous)
    assert (paths.dir / "f").read_text() == "v3" and not paths.previous.exists()


def test_resolving_a_missing_tag_names_the_directory(tmp_path):
    with pytest.raises(CheckpointError, match=f"checkpoint directory {tmp_path}/nope does not exist"):
        resolve_tag_dir(CheckpointPaths(tmp_path, "nope"))


def test_safetensors_round_trip_of_every_common_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=g),
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(),
        "f64": torch.randn(2, generator=g).double(),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "f8e5": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(7),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.tensor([-2, 300], dtype=torch.int16),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([255], dtype=torch.uint8),
        "u32": torch.tensor([2**32 - 1], dtype=torch.uint32),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "noncontig": torch.arange(12.0).view(3, 4).t(),
        "halves_a": torch.arange(8.0)[:4],
        "grad": torch.ones(2, requires_grad=True),
    }
    tensors["halves_b"] = tensors["halves_a"]._base[4:]  # disjoint views of one buffer are fine
    write_safetensors(tmp_path / "x.safetensors", tensors, {"k": "v"})
    back, meta = read_safetensors(tmp_path / "x.safetensors")
    assert meta == {"k": "v"} and list(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v.detach()), k
    back["f32"].add_(1)  # a copy-on-write map: the file keeps its bytes
    assert torch.equal(read_safetensors(tmp_path / "x.safetensors")[0]["f32"], tensors["f32"])


def test_zerospeed_and_the_safetensors_package_read_each_others_files(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "w": torch.randn(3, 5, generator=g),
        "h": torch.randn(4, generator=g).bfloat16(),
        "i": torch.arange(3),
        "b": torch.tensor([True]),
    }
    write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "pt", "tied": "{}"})
    theirs = safetensors_torch.load_file(str(tmp_path / "ours.safetensors"))
    assert theirs.keys() == tensors.keys() and all(torch.equal(theirs[k], v) for k, v in tensors.items())
    with safetensors.safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "tied": "{}"}
    safetensors_torch.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    back, meta = read_safetensors(tmp_path / "theirs.safetensors")
    assert meta == {"k": "v"} and back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    part, _ = read_safetensors(tmp_path / "theirs.safetensors", names=["i"])
    assert list(part) == ["i"] and torch.equal(part["i"], tensors["i"])


def test_a_bad_safetensors_file_or_a_missing_tensor_names_the_file(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": torch.ones(4)})
    with pytest.raises(SafetensorsError, match=rf"{path} holds no tensor 'nope' \(it holds 1\)"):
        read_safetensors(path, names=["a", "nope"])
    data = path.read_bytes()
    for bad in (data[:-4], b"\x00" * 5, struct.pack("<Q", 4) + b"{no}"):
        path.write_bytes(bad)
        with pytest.raises(
            SafetensorsError, match=rf"{path} is not a readable safetensors file .*truncated or corrupt"
        ):
            read_safetensors(path)
    with pytest.raises(FileNotFoundError):
        read_safetensors(tmp_path / "absent.safetensors")


def test_a_failed_safetensors_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"w": torch.zeros(64)})
    real_save = safetensors_io.save_file

    def dies_half_way(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(Path(filename).stat().st_size // 2)
        raise RuntimeError("killed")

    monkeypatch.setattr(safetensors_io, "save_file", dies_half_way)
    with pytest.raises(RuntimeError, match="killed"):
        write_safetensors(path, {"w": torch.ones(64)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert torch.equal(read_safetensors(path)[0]["w"], torch.zeros(64))


def test_shared_memory_is_refused_by_the_writer_and_cloned_by_the_export(tmp_path):
    w = torch.arange(8.0)
    with pytest.raises(RuntimeError, match="share memory"):
        write_safetensors(tmp_path / "s.safetensors", {"a": w, "b": w})
    with pytest.raises(TypeError, match=r"cannot store \['c'\] of dtype torch.complex128"):
        write_safetensors(tmp_path / "c.safetensors", {"c": torch.zeros(2, dtype=torch.complex128)})
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    sd = {
        "all": w,
        "head": w[:4],
        "tail": w[4:],
        "mid": w[2:6],
        "alias": w,
        "flat": w.view(2, 4),
        "empty_inside": w[3:3],
        "t": torch.ones(2, 3).t(),
    }
    disjoint = {k: sd[k] for k in ("head", "tail", "t")}
    assert all(v is disjoint[k] for k, v in clone_overlapping(disjoint).items())  # no copy
    kept = clone_overlapping({k: sd[k] for k in ("head", "mid", "all", "tail")})
    assert kept["all"] is w and all(kept[k].data_ptr() != sd[k].data_ptr() for k in ("head", "mid", "tail"))
    assert all(torch.equal(kept[k], sd[k]) for k in kept)
    export_state_dict(sd, tmp_path / "out")
    back = read_exported(tmp_path / "out")
    assert back.keys() == sd.keys() and back["alias"] is back["all"]
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def _loader(rank, world, micro, n=24):
    data = torch.utils.data.TensorDataset(torch.arange(n))
    return ShardedDataLoader(data, micro, rank=rank, world_size=world, seed=3)


def _ids(batch):
    return batch[0].tolist()


def test_the_loader_resumes_mid_epoch_at_another_world_size():
    old = [_loader(r, 2, 2) for r in range(2)]
    its = [iter(l) for l in old]
    seen = [i for it in its for _ in range(2) for i in _ids(next(it))]  # 2 micro-batches on each rank
    state = old[0].state_dict()
    assert state == {"epoch": 0, "position": 2, "micro_batch": 2, "world_size": 2, "num_samples": 24}
    rest_whole = [i for it in its for b in it for i in _ids(b)]
    new = [_loader(r, 4, 1) for r in range(4)]
    for loader in new:
        loader.load_state_dict(state)
    rest = [i for loader in new for b in loader for i in _ids(b)]
    assert len(seen) == 8 and sorted(seen + rest) == list(range(24))
    assert sorted(rest) == sorted(rest_whole)
    # the next pass is the next epoch, from its start
    assert all(loader.state_dict()["epoch"] == 1 for loader in new)
    assert len([b for b in new[0]]) == 6


def test_a_pass_begun_before_the_load_jumps_to_the_loaded_position():
    first = _loader(0, 1, 4)
    it = RepeatingLoader(first)
    for _ in range(8):  # 6 batches of epoch 0, 2 of epoch 1
        next(it)
    assert first.state_dict()["epoch"] == 1 and first.state_dict()["position"] == 2
    state = first.state_dict()
    later = _loader(0, 1, 4)
    live = RepeatingLoader(later)  # starts epoch 0 before the state arrives
    later.load_state_dict(state)
    assert _ids(next(live)) == _ids(next(it))
    assert _ids(next(live)) == _ids(next(it))


def test_loader_len_and_old_state_format():
    loader = _loader(0, 2, 5)
    assert len(loader) == 3  # 12 samples per rank in batches of 5, the last one short
    loader.load_state_dict({"epoch": 4})  # written before positions were recorded
    assert loader.state_dict()["epoch"] == 4 and loader.state_dict()["position"] == 0
    assert len(list(loader)) == 3 and loader.state_dict()["epoch"] == 5
