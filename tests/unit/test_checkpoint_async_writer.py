"""The pure parts of asynchronous checkpoints: DeepSpeed's keys mapped onto a WriterPlan, the host snapshot,
the full-disk message, the parallel verification, and the split of a pipeline stage's layer files."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from zerospeed.checkpoint.async_writer import (
    BackgroundWriter,
    WriteJob,
    WriterPlan,
    _describe_write_error,
    host_snapshot,
    payload_bytes,
)
from zerospeed.checkpoint.manifest import file_record, verify_files
from zerospeed.config import parse_config
from zerospeed.parallel.pipeline.checkpoint import layers_written
from zerospeed.runtime.checkpoint_saves import writer_plan
from zerospeed.utils.errors import ConfigError


def _plan(extra: dict) -> WriterPlan:
    return writer_plan(parse_config({"train_batch_size": 1, **extra}))


def test_deepspeed_keys_map_onto_the_plan():
    assert _plan({}) == WriterPlan()
    assert not _plan({}).asynchronous
    writer = _plan({"checkpoint": {"writer": {"io_buffer_size": 4096, "show_statistics": True}}})
    assert not writer.asynchronous and writer.io_buffer_bytes == 4096 and writer.show_statistics
    assert _plan({"checkpoint": {"writer": {"decoupled": True}}}).asynchronous
    datastates = _plan({"datastates_ckpt": {"host_cache_size": 2}})
    assert datastates.asynchronous and datastates.host_cache_bytes == 2 * 1024**3
    assert _plan({"datastates_ckpt": {}}).host_cache_bytes is None
    assert _plan({"casync_ckpt": {}}).asynchronous
    assert _plan({"async_load": True}).async_load
    assert _plan({"checkpoint": {"use_node_local_storage": True}}).node_local


def test_the_mock_writer_is_refused():
    with pytest.raises(ConfigError, match="MOCK checkpoint writer"):
        parse_config({"train_batch_size": 1, "checkpoint": {"writer": {"type": "mock"}}})


def test_snapshot_shares_nothing_with_the_live_state_and_keeps_ties():
    weight = torch.arange(6.0)
    flat = torch.zeros(10)
    view = flat[2:5]
    state = {"w": weight, "tied": weight, "view": view, "nested": [{"step": 3, "lr": 0.1}], "name": "x"}
    (snap,), nbytes = host_snapshot([state])
    weight.add_(1)
    flat.fill_(7)
    state["nested"][0]["step"] = 4
    assert torch.equal(snap["w"], torch.arange(6.0)) and snap["tied"] is snap["w"]
    assert torch.equal(snap["view"], torch.zeros(3)) and snap["view"].untyped_storage().nbytes() == 12
    assert snap["nested"] == [{"step": 3, "lr": 0.1}] and snap["name"] == "x"
    assert nbytes == 6 * 4 + 3 * 4
    assert payload_bytes(snap) == nbytes


def test_full_disk_message_names_the_file_and_the_bytes(tmp_path):
    path = tmp_path / ".t.partial" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.parent.mkdir()
    message = _describe_write_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), path, 123456789)
    assert str(path) in message and "123,456,789 bytes" in message and "bytes are free there" in message
    assert "previous checkpoint and `latest` are untouched" in message
    other = _describe_write_error(PermissionError(errno.EACCES, "denied"), path, 1)
    assert other.startswith(f"could not write checkpoint file {path}: PermissionError")


def test_background_writer_writes_and_reports(tmp_path):
    writer = BackgroundWriter()
    job = WriteJob(tmp_path, [("a.pt", {"x": torch.ones(3)}), ("b.pt", {"y": torch.zeros(2)})], io_buffer_bytes=4096)
    writer.start(job)
    writer.join()
    assert writer.done() and job.error is None and sorted(job.records) == ["a.pt", "b.pt"]
    assert job.records["a.pt"] == file_record(tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt")["x"], torch.ones(3))
    failing = WriteJob(tmp_path / "missing", [("c.pt", {})])
    writer.start(failing)
    writer.join()
    assert "could not write checkpoint file" in failing.error and "c.pt" in failing.error


def test_parallel_verification_finds_the_same_problems(tmp_path):
    names = [f"f{i}.bin" for i in range(5)]
    for i, n in enumerate(names):
        (tmp_path / n).write_bytes(bytes([i]) * (1000 + i))
    manifest = {"files": {n: file_record(tmp_path / n) for n in names}}
    assert verify_files(tmp_path, manifest, names, workers=4) is None
    (tmp_path / "f3.bin").write_bytes(b"short")
    assert verify_files(tmp_path, manifest, names, workers=4) == verify_files(tmp_path, manifest, names)
    assert "f3.bin is truncated" in verify_files(tmp_path, manifest, names, workers=4)
    assert "not listed" in verify_files(tmp_path, json.loads(json.dumps(manifest)), ["g.bin"], workers=4)


def test_pipeline_stage_layer_files_split_as_deepspeed_splits_them():
    layers = list(range(9))
    assert layers_written(layers, 0, 2, parallel=True) == [0, 1, 2, 3, 4]
    assert layers_written(layers, 1, 2, parallel=True) == [5, 6, 7, 8]
    assert layers_written(layers, 0, 2, parallel=False) == layers
    assert layers_written(layers, 1, 2, parallel=False) == []
    split = [layers_written(layers, r, 4, parallel=True) for r in range(4)]
    assert split == [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
    assert layers_written([1, 2], 2, 3, parallel=True) == []
