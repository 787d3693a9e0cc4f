"""Asynchronous checkpoint saves on 2 ranks (checkpoint/async_writer.py).

- Resume from an asynchronous save is bitwise equal to the uninterrupted run, at ZeRO stages 0-3, while
  training went on during the write: the writer is held until the saving engine has trained on (its
  weights and optimizer states changed in place), so a snapshot that shared memory with the live state
  would write the later values. `latest` moves only at the commit. Each stage asks for the asynchronous
  writer with another of DeepSpeed's keys (`checkpoint.writer.decoupled`, `datastates_ckpt`, `casync_ckpt`).
- A full disk (ENOSPC, injected at the write call: torch.save on one rank writes 4 KiB and fails with
  errno ENOSPC) raises on every rank, naming the file and the bytes needed; the previous checkpoint and
  `latest` stay and load.
- Node-local storage: each rank plays a node of its own (LOCAL_RANK 0, its own directory); each node's
  directory alone loads, at stages 0 and 1.
- `checkpoint.parallel_write.pipeline_stage`: a stage's layer files are shared out among its data-parallel
  ranks (5 + 4 of 9 on 2 ranks, as DeepSpeed splits them), and load.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import _train, assert_same, make_engine, rank_snapshot, seed_everything
from test_pipe_parity import MODEL as PIPE_MODEL
from test_pipe_parity import build_gpt
from test_pipe_parity import config as pipe_config
from test_pipe_parity import global_batches as pipe_batches
from test_pipe_parity import micro_batches as pipe_micro_batches
from test_zero_parity import SEQ, zero_config

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.checkpoint import async_writer
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.parallel.pipeline import checkpoint as pipe_checkpoint
from zerospeed.pipe import PipelineModule
from zoo.data import ByteSequenceDataset, stdlib_corpus
from zoo.gpt_layers import gpt_layer_specs, lm_loss

WRITER_KEYS = {
    0: {"checkpoint": {"writer": {"decoupled": True, "io_buffer_size": 1 << 16, "show_statistics": True}}},
    1: {"datastates_ckpt": {"host_cache_size": 1}},
    2: {"casync_ckpt": {}},
    3: {"checkpoint": {"writer": {"type": "PYTHON", "decoupled": True}}},
}


def _held_writer():
    """Make the background writer wait for the returned event before writing."""
    release = threading.Event()
    real_run = async_writer.WriteJob.run

    def held_run(job):
        release.wait(60)
        real_run(job)

    async_writer.WriteJob.run = held_run
    return release, lambda: setattr(async_writer.WriteJob, "run", real_run)


def _latest(root: str) -> str | None:
    path = Path(root) / "latest"
    return path.read_text() if path.is_file() else None


def _async_resume_job(stage: int, root: str, n: int = 2, m: int = 3) -> dict:
    config = zero_config(stage, **WRITER_KEYS[stage])
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=22 * SEQ + 1), SEQ)
    engine, loader = make_engine(config, training_data=data)
    seed_everything(7)
    batches = iter(zerospeed.RepeatingLoader(loader))
    log_first: list = []
    _train(engine, batches, n, log_first)
    release, restore = _held_writer()
    try:
        engine.save_checkpoint(root, client_state={"stage": stage})
        saved_tag = f"global_step{n}"
        log_rest: list = []
        _train(engine, batches, m, log_rest)  # the state changes in place while the save is in flight
        latest_during = _latest(root)
        staged = sorted(p.name for p in Path(root).iterdir()) if comm.get_rank() == 0 else []
        comm.barrier()
        release.set()
        engine.wait_for_checkpoint()
    finally:
        restore()
    latest_after = _latest(root)
    whole = rank_snapshot(engine)

    resumed, resumed_loader = make_engine(config, seed=1, training_data=data)
    resumed_batches = zerospeed.RepeatingLoader(resumed_loader)
    seed_everything(99)
    path, client = resumed.load_checkpoint(root)
    log_resumed: list = []
    _train(resumed, resumed_batches, m, log_resumed)
    return {
        "latest_during": latest_during,
        "latest_after": latest_after,
        "saved_tag": saved_tag,
        "staged": staged,
        "client": client,
        "log_rest": log_rest,
        "log_resumed": log_resumed,
        "whole": whole,
        "resumed": rank_snapshot(resumed),
    }


def _async_all_stages(root: str) -> dict:
    return {stage: _async_resume_job(stage, f"{root}/stage{stage}") for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def async_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return run_distributed(_async_all_stages, 2, str(root), timeout=170)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_from_an_async_save_is_bitwise_identical(async_resumed, stage):
    for rank, by_stage in enumerate(async_resumed):
        r = by_stage[stage]
        assert r["latest_during"] is None, "latest moved before the files were written"
        assert r["latest_after"] == r["saved_tag"]
        if rank == 0:  # while the writer was held: only the staging directory
            assert r["staged"] == [f".{r['saved_tag']}.partial"]
        assert r["client"] == {"stage": stage}
        assert r["log_resumed"] == r["log_rest"], f"rank {rank}: losses differ after the resume"
        assert_same(r["whole"], r["resumed"], f"rank {rank} stage {stage}")


def _enospc_job(root: str, asynchronous: bool) -> dict:
    over = WRITER_KEYS[1] if asynchronous else {}
    engine, _ = make_engine(zero_config(2, **over))
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=8 * SEQ + 1), SEQ)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=2))
    _train(engine, batches, 1, [])
    engine.save_checkpoint(root, tag="good")
    engine.wait_for_checkpoint()
    good = rank_snapshot(engine)
    _train(engine, batches, 1, [])

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    error = None
    if comm.get_rank() == 1:
        torch.save = full_disk
    try:
        engine.save_checkpoint(root, tag="bad")
        engine.wait_for_checkpoint()
    except CheckpointError as exc:
        error = str(exc)
    finally:
        torch.save = real_save
    listing = sorted(p.name for p in Path(root).iterdir())
    fresh, _ = make_engine(zero_config(2), seed=3)
    path, _ = fresh.load_checkpoint(root)
    return {
        "error": error,
        "latest": _latest(root),
        "listing": listing,
        "path": path,
        "good": good,
        "loaded": rank_snapshot(fresh),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, asynchronous):
    results = run_distributed(_enospc_job, 2, str(tmp_path), asynchronous, timeout=110)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank}: no error for the failed save"
        assert "no space left on the device" in r["error"]
        assert str(tmp_path / ".bad.partial" / "zero_pp_rank_1_mp_rank_00_optim_states.pt") in r["error"]
        assert "bytes" in r["error"] and "need about" in r["error"]
        assert r["latest"] == "good"
        assert r["listing"] == ["good", "latest"], "the failed save left files behind"
        assert r["path"] == str(tmp_path / "good" / "mp_rank_00_model_states.pt")
        assert_same(r["good"]["masters"], r["loaded"]["masters"], f"rank {rank} masters")
        assert_same(r["good"]["states"], r["loaded"]["states"], f"rank {rank} states")


def _node_local_job(root: str, stage: int) -> dict:
    os.environ["LOCAL_RANK"] = "0"  # every rank is alone on its node
    node_dir = f"{root}/node{comm.get_rank()}"
    config = zero_config(stage, checkpoint={"use_node_local_storage": True}, **WRITER_KEYS[2])
    engine, _ = make_engine(config)
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=8 * SEQ + 1), SEQ)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=2))
    _train(engine, batches, 2, [])
    engine.save_checkpoint(node_dir)
    saved = rank_snapshot(engine)
    engine.destroy()  # flushes the save in flight
    files = sorted(p.name for p in (Path(node_dir) / "global_step2").iterdir())
    fresh, _ = make_engine(config, seed=5)
    fresh.load_checkpoint(node_dir)
    return {"files": files, "latest": _latest(node_dir), "saved": saved, "loaded": rank_snapshot(fresh)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1])
def test_node_local_storage_each_node_loads_its_own_copy(tmp_path, stage):
    results = run_distributed(_node_local_job, 2, str(tmp_path), stage, timeout=110)
    for rank, r in enumerate(results):
        assert r["latest"] == "global_step2"
        other = f"zero_pp_rank_{1 - rank}_mp_rank_00_optim_states.pt"
        assert other not in r["files"], f"node {rank} holds another node's file"
        assert "mp_rank_00_model_states.pt" in r["files"] and "zerospeed_manifest.json" in r["files"]
        assert_same(r["saved"]["masters"], r["loaded"]["masters"], f"rank {rank} masters")
        assert_same(r["saved"]["states"], r["loaded"]["states"], f"rank {rank} states")
        assert_same(r["saved"]["module"], r["loaded"]["module"], f"rank {rank} module")


def _pipeline_parallel_write_job(root: str) -> dict:
    """One pipeline stage, 2 data-parallel ranks: with `parallel_write.pipeline_stage` each rank writes half
    of the stage's layer files; a run without it loads them and continues as the saving run does."""

    def build(parallel: bool):
        module = PipelineModule(gpt_layer_specs(PIPE_MODEL, build_gpt()), num_stages=1, loss_fn=lm_loss)
        cfg = {**pipe_config(2), "checkpoint": {"parallel_write": {"pipeline_stage": parallel}}}
        engine, *_ = zerospeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
        return engine

    written = []
    real = pipe_checkpoint.atomic_torch_save

    def spy(obj, path):
        written.append(Path(path).name)
        real(obj, path)

    batches = pipe_batches(2, 2, 4)
    pipe_checkpoint.atomic_torch_save = spy
    try:
        first = build(True)
        for b in batches[:2]:
            first.train_batch(pipe_micro_batches(first, b, 2))
        first.save_checkpoint(root)
    finally:
        pipe_checkpoint.atomic_torch_save = real
    second = build(False)
    second.load_checkpoint(root)
    resumed = [second.train_batch(pipe_micro_batches(second, b, 2)).item() for b in batches[2:]]
    whole = [first.train_batch(pipe_micro_batches(first, b, 2)).item() for b in batches[2:]]
    return {"written": sorted(n for n in written if n.endswith("-model_states.pt")), "resumed": resumed, "whole": whole}


@pytest.mark.timeout(120)
def test_parallel_write_shares_a_stages_layer_files_among_data_parallel_ranks(tmp_path):
    results = run_distributed(_pipeline_parallel_write_job, 2, str(tmp_path), timeout=110)
    n_layers = PIPE_MODEL.n_layer + 4  # the blocks, embedding, final norm, head, ...: as test_pipe_checkpoint counts
    expected = [f"layer_{i:02d}-model_states.pt" for i in range(n_layers)]
    first_half = (n_layers + 1) // 2
    assert results[0]["written"] == expected[:first_half]
    assert results[1]["written"] == expected[first_half:]
    for r in results:
        assert r["resumed"] == r["whole"]
