"""Resumable checkpoints of AutoEP models (Note [stacked expert checkpoints] in checkpoint/experts.py),
against stock transformers in one plain process.

Four ranks train a tiny Mixtral (4 experts, top-2, the router aux loss in the loss) with AutoEP
(`autoep_size` 2, ZeRO-2) for 3 steps and save. Fresh engines, built from a different seed, load the
checkpoint at the same layout, at ep 4 with ZeRO-3 (one expert per rank) and at ep 1 with ZeRO-1 (every
expert on every rank), and train 2 more steps. The reference is the stock model over the same 5 global
batches (test_moe_autoep_parity's AdamW step with an acting clip): every replica's loss at every step and
the final weights within 1e-5. The checkpoint itself, consolidated offline with no process group
(`get_fp32_state_dict_from_zero_checkpoint`), loads strictly into the stock model and equals the
reference after 3 steps, as does `save_16bit_model`'s file; a weights-only load
(`load_module_only`, at ep 4 and ZeRO-0) reads the model states and the per-expert files.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zerospeed import comm

transformers = pytest.importorskip("transformers")
from test_moe_autoep_parity import TOL, WORLD, B, batches, build, config, reference  # noqa: E402

SAVED_AT, STEPS = 3, 5
RESUMES = [(2, 2), (4, 3), (1, 1)]  # (autoep_size, ZeRO stage) of the loading engine


def _engine(ep: int, stage: int, seed: int):
    import zerospeed

    torch.manual_seed(seed)
    model = build("mixtral")
    if seed:  # another initialisation: only the checkpoint can make it the reference's model
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.5)
    cfg = config("mixtral", stage)
    cfg["expert_parallel"]["autoep_size"] = ep
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    return engine, model


def _steps(engine, steps: range) -> list[float]:
    rank, losses = comm.get_rank(), []
    for ids in [batches()[s] for s in steps]:
        mine = ids[rank * B : (rank + 1) * B]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _final_weights(engine, model) -> dict:
    from zerospeed.moe.autoep import consolidated_state_dict
    from zerospeed.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        state = {k: v.detach().clone() for k, v in consolidated_state_dict(model).items()}
    return state if comm.get_rank() == 0 else {}


def _save_then_resume(root: str) -> dict:
    engine, model = _engine(2, 2, seed=0)
    first = _steps(engine, range(SAVED_AT))
    engine.save_checkpoint(root, tag="autoep")
    engine.save_16bit_model(root, "model16.bin")  # rank 0 writes every expert, transformers' layout
    engine.zero.remove_hooks()
    out = {"first": first}
    engine, model = _engine(4, 0, seed=1)  # weights only: the model states and the per-expert files
    engine.load_checkpoint(root, tag="autoep", load_module_only=True)
    out["module_only"] = _final_weights(engine, model)
    engine.zero.remove_hooks()
    for ep, stage in RESUMES:
        engine, model = _engine(ep, stage, seed=1)
        path, _ = engine.load_checkpoint(root, tag="autoep")
        assert path is not None and engine.global_steps == SAVED_AT
        out[(ep, stage)] = {"losses": _steps(engine, range(SAVED_AT, STEPS)), "weights": _final_weights(engine, model)}
        engine.zero.remove_hooks()
    return out


def _worst(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    return max((got[k] - v).abs().max().item() for k, v in ref.items())


@pytest.mark.timeout(240)
def test_autoep_checkpoint_resumes_at_any_expert_parallel_size_and_stage(tmp_path):
    from zerospeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

    results = run_distributed(_save_then_resume, WORLD, str(tmp_path), timeout=220)
    ref_losses, ref_final = reference("mixtral", STEPS)
    ref_saved = reference("mixtral", SAVED_AT)[1]
    for r in range(WORLD):
        assert max(abs(a - b) for a, b in zip(results[r]["first"], ref_losses[r][:SAVED_AT])) <= TOL, r
        for resume in RESUMES:
            got = results[r][resume]["losses"]
            assert max(abs(a - b) for a, b in zip(got, ref_losses[r][SAVED_AT:])) <= TOL, (resume, r, got)
    for resume in RESUMES:
        assert _worst(results[0][resume]["weights"], ref_final) <= TOL, resume
    # weights only, at ep 4 and ZeRO-0: from the model states and the expert files
    assert _worst(results[0]["module_only"], ref_saved) <= TOL
    # the checkpoint on its own: every expert once, in transformers' names and shapes
    for state in (
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="autoep"),
        torch.load(tmp_path / "model16.bin", weights_only=True),
    ):
        plain = build("mixtral")
        plain.load_state_dict(state, strict=True)
        assert _worst(plain.state_dict(), ref_saved) <= TOL
