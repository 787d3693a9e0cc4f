"""Checkpoints of AutoEP models under Ulysses sequence parallelism, against stock transformers.

A tiny Mixtral (4 experts, top-2; test_ulysses_hf's) trains on 4 ranks at sp 2 x dp 2 with AutoEP over
2 ranks of the sequence-data-parallel group (ZeRO-2) for 2 steps and saves: the expert weights are
partitioned over expert groups that split dp x sp (Note [expert layout]), the dense state over dp x sp
(Note [sequence-parallel checkpoints]), and the stacked experts are addressed inside the whole `[E, ...]`
tensor (Note [stacked expert checkpoints]). Fresh engines built from another initialisation load it at the
same layout, at ep 4 with ZeRO-3 (one expert per rank) and at ep 1 with ZeRO-1 (every expert on every
rank), and train 2 more steps.

The reference is the stock model in one process over the same 4 global batches (two data-parallel
replicas, the mean of their losses): every rank's loss at every step and the final weights within 1e-5,
which needs the weights, AdamW's moments and step all restored for dense and expert parameters alike.
"""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import run_distributed

pytest.importorskip("transformers")
from test_ulysses_hf import MICRO, STEPS, TOL, batches, build, reference  # noqa: E402

SP, SAVED_AT = 2, 2
SAVE = (2, 2)  # (AutoEP size, ZeRO stage) of the saving run
RESUMES = [(2, 2), (4, 3), (1, 1)]


def _engine(ep: int, stage: int, seed: int):
    from zerospeed.sequence.hf import UlyssesSPAttentionHF, install_sequence_parallel_loss

    model = build(ep)
    if seed:  # another initialisation: only the checkpoint can make it the reference's model
        torch.manual_seed(seed)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.5)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, MICRO)
    install_sequence_parallel_loss(model, mpu.get_sequence_parallel_group())
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": SP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": ep},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg, mpu=mpu)
    return engine, model, mpu


def _steps(engine, mpu, steps: range) -> list[float]:
    from zerospeed.sequence.data import shard_sequence_batch

    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    losses = []
    for s in steps:
        mine = {k: v[dp_rank * MICRO : (dp_rank + 1) * MICRO] for k, v in batches(dp)[s].items()}
        loss = engine(**shard_sequence_batch(mine, mpu.get_sequence_parallel_rank(), SP)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_then_resume(root: str) -> dict:
    from zerospeed.moe.autoep import consolidated_state_dict
    from zerospeed.sequence.hf import UlyssesSPAttentionHF

    out = {}
    for i, (ep, stage) in enumerate([SAVE, *RESUMES]):
        try:
            engine, model, mpu = _engine(ep, stage, seed=i)
            out["dp_rank"] = mpu.get_data_parallel_rank()
            if i == 0:
                out["saved"] = _steps(engine, mpu, range(SAVED_AT))
                engine.save_checkpoint(root, tag="autoep-sp")
            else:
                path, _ = engine.load_checkpoint(root, tag="autoep-sp")
                assert path is not None and engine.global_steps == SAVED_AT
                losses = _steps(engine, mpu, range(SAVED_AT, STEPS))
                with zerospeed.zero.GatheredParameters(list(model.parameters())):  # every expert
                    weights = {k: v.detach().clone() for k, v in consolidated_state_dict(model).items()}
                out[(ep, stage)] = {"losses": losses, "weights": weights}
            engine.zero.remove_hooks()
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
    return out


@pytest.mark.timeout(300)
def test_autoep_under_ulysses_resumes_at_other_expert_parallel_sizes_and_stages(tmp_path):
    results = run_distributed(_save_then_resume, 4, str(tmp_path), timeout=270)
    ref_losses, ref_weights = reference(4 // SP, ep=1)
    for rank, res in enumerate(results):
        expect = [step[res["dp_rank"]] for step in ref_losses]
        assert max(abs(a - b) for a, b in zip(res["saved"], expect[:SAVED_AT])) <= TOL, (rank, res["saved"])
        for resume in RESUMES:
            got = res[resume]["losses"]
            assert max(abs(a - b) for a, b in zip(got, expect[SAVED_AT:])) <= TOL, (resume, rank, got, expect)
            for key, value in ref_weights.items():
                torch.testing.assert_close(
                    res[resume]["weights"][key],
                    value,
                    atol=TOL,
                    rtol=0,
                    msg=lambda m, key=key: f"{resume} rank {rank} {key}: {m}",
                )
