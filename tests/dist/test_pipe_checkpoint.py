"""Per-layer pipeline checkpoints: saved at 2 stages x 2 data-parallel, resumed at 4 stages."""

from __future__ import annotations

import os

import pytest
from test_pipe_parity import MODEL, build_engine, global_batches, micro_batches, reference

from harness import run_distributed
from zerospeed import comm
from zerospeed.utils.errors import ConfigError

STEPS = 6


def save_then_resume(save_dir: str) -> dict:
    batches = global_batches(2, 4, STEPS)  # 16 samples per step: 2 dp x 4 micro-batches, or 1 x 8
    first = build_engine(2, 4)
    before = [first.train_batch(micro_batches(first, b, 4)).item() for b in batches[:3]]
    first.save_checkpoint(save_dir, client_state={"note": "half-way"})
    second = build_engine(4, 8)  # twice the stages, half the data-parallel ranks
    path, client = second.load_checkpoint(save_dir)
    after = [second.train_batch(micro_batches(second, b, 8)).item() for b in batches[3:]]
    # ZeRO-1 optimizer states are tied to their layout: a clear error at another stage count
    zero1 = build_engine(2, 4, stage=1)
    zero1.train_batch(micro_batches(zero1, batches[0], 4))
    zero1.save_checkpoint(save_dir, tag="zero1")
    error = None
    try:
        build_engine(4, 8, stage=1).load_checkpoint(save_dir, tag="zero1")
    except ConfigError as exc:
        error = str(exc)
    return {
        "losses": before + after,
        "steps": second.global_steps,
        "client": client,
        "path": path,
        "error": error,
        "rank": comm.get_rank(),
    }


@pytest.mark.timeout(150)
def test_checkpoint_saved_at_two_stages_resumes_at_four_with_the_same_losses(tmp_path):
    results = run_distributed(save_then_resume, 4, str(tmp_path))
    ref = reference(2, 4, STEPS)["losses"]
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-5, (r["losses"], ref)
        assert r["steps"] == STEPS and r["client"] == {"note": "half-way"}
        assert r["path"] == str(tmp_path / "global_step3")
        assert "ZeRO-1 optimizer states were saved by layout" in r["error"]
        assert "load_optimizer_states=False" in r["error"]
    n_layers = MODEL.n_layer + 4
    files = sorted(os.listdir(tmp_path / "global_step3"))
    assert files == sorted(
        [f"layer_{i:02d}-model_states.pt" for i in range(n_layers)]
        + [f"layer_{i:02d}-optim_states.pt" for i in range(n_layers)]
        + ["engine_states.pt"]
    )
    assert (tmp_path / "latest").read_text() == "zero1"
