"""The engine's side of asynchronous checkpoints: DeepSpeed's writer keys resolved into a `WriterPlan`, and the
step hook that commits a save in flight at each optimizer step (checkpoint/async_writer.py has the design).

DeepSpeed's keys and what each does here (docs/checkpoints.md, "Asynchronous saves"):

  checkpoint.writer                  DeepSpeed's fast writer; present: saves go through zerospeed's writer
    .decoupled                       true: asynchronous saves (DeepSpeed writes from a separate process)
    .type                            FAST / PYTHON: both write real files; MOCK, DeepSpeed's I/O
                                     benchmark that writes nothing, is refused (config/features.py)
    .io_buffer_size                  the file buffer each checkpoint file is written through
    .io_buffer_double                accepted; the background thread already overlaps writing with training
    .show_statistics                 log bytes, seconds, GB/s and the training stall of every save
    .data_parallel, .io_multiplier   accepted; every rank already writes only its own shard
  datastates_ckpt                    present: asynchronous saves; host_cache_size (GB) bounds the snapshot
                                     (a larger one is written synchronously, with a warning)
  casync_ckpt                        present: asynchronous saves
  async_load                         load_checkpoint reads this rank's files on background threads
  checkpoint.use_node_local_storage  every node writes and reads its own copy (local rank 0 writes the
                                     manifest and `latest` there)
  checkpoint.deepspeed_layout        zerospeed's key: ZeRO 0-3 files DeepSpeed loads as saved
"""

from __future__ import annotations

from zerospeed.checkpoint.async_writer import WriterPlan
from zerospeed.checkpoint.save import AsyncSaves
from zerospeed.runtime.hooks import StepHook

GIB = 1024**3


def writer_plan(config) -> WriterPlan:
    """The `WriterPlan` of a parsed config (the module docstring maps the keys)."""
    ckpt = config.checkpoint
    writer = ckpt.writer
    datastates = config.datastates_ckpt
    cache_gb = (datastates or {}).get("host_cache_size")
    return WriterPlan(
        asynchronous=(writer is not None and writer.decoupled)
        or datastates is not None
        or config.casync_ckpt is not None,
        io_buffer_bytes=writer.io_buffer_size if writer is not None else WriterPlan.io_buffer_bytes,
        show_statistics=writer is not None and writer.show_statistics,
        host_cache_bytes=int(float(cache_gb) * GIB) if cache_gb is not None else None,
        async_load=config.async_load,
        node_local=ckpt.use_node_local_storage,
        deepspeed_layout=ckpt.deepspeed_layout,
    )


class CheckpointCommitHook(StepHook):
    """After each optimizer step, commit the save in flight when every rank's writer is done (one small
    all-gather while a save is in flight, none otherwise); the engine adds it with its first asynchronous
    save. A failed write raises here, at the step after it was noticed."""

    def __init__(self, saves: AsyncSaves):
        self.saves = saves

    def after_step(self, engine) -> None:
        if self.saves.in_flight():
            self.saves.poll()


def engine_saves(engine) -> AsyncSaves:
    """The engine's `AsyncSaves`, made from its config on first use (with the commit hook on its step hooks
    when saves are asynchronous)."""
    saves = getattr(engine, "_checkpoint_saves", None)
    if saves is None:
        saves = AsyncSaves(writer_plan(engine.config))
        engine._checkpoint_saves = saves
        if saves.plan.asynchronous:
            engine.step_hooks.append(CheckpointCommitHook(saves))
    return saves


def flush_saves(engine) -> None:
    """Collective: wait for the engine's save in flight, if any, and commit it."""
    saves = getattr(engine, "_checkpoint_saves", None)
    if saves is not None:
        saves.flush()
