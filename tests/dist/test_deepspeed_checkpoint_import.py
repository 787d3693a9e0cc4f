"""Resuming a DeepSpeed run in zerospeed: checkpoints saved by DeepSpeed 0.19.8 itself (tests/fixtures, at ZeRO
0-3 on 2 ranks after 3 of 6 steps) loaded by `engine.load_checkpoint` (Note [DeepSpeed checkpoints] in
checkpoint/deepspeed_import.py), then trained for steps 4-6 on the same batches.

The reference is DeepSpeed's own continuation, recorded when the fixtures were made: its losses for steps
4-6 and its fp32 weights after step 6 (DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`). Each
DeepSpeed stage resumes at another zerospeed stage and on 2 ranks, and one on a single rank (4
accumulation steps for the same global batch): losses and weights agree within 1e-6, so the weights,
Adam moments and step count, the warm-up LR schedule's position, the buffer and the counters all came
across. The universal form read from DeepSpeed's files equals DeepSpeed's own consolidation exactly.
Loading without the optimizer states gives different losses (checked: the test can fail).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, continue_fixture_run, fixture_model, fixture_script

# (DeepSpeed's stage, zerospeed's stage, zerospeed's ranks)
CASES = [(0, 2, 2), (1, 3, 2), (2, 0, 2), (3, 1, 2), (3, 2, 1)]


def model():
    return fixture_model()


def _resume(ds_stage: int, stage: int, with_optimizer: bool = True):
    import zerospeed
    from zerospeed import comm

    world = comm.get_world_size()
    gas = 4 // world
    m = model()
    # (no gradient_clipping key, as in DeepSpeed's run: both clip at the default, 1.0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(
        str(FIXTURES / f"zero{ds_stage}"),
        tag="step3",
        load_optimizer_states=with_optimizer,
        load_lr_scheduler_states=with_optimizer,
    )
    steps = engine.global_steps
    losses = continue_fixture_run(engine, m, gas)
    with zerospeed.zero.GatheredParameters(list(m.parameters())):
        weights = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return {"losses": losses, "weights": weights, "steps": steps}


def _cases(cases):
    return {(ds, stage): _resume(ds, stage) for ds, stage in cases}


def _expected(ds_stage: int) -> dict:
    return torch.load(FIXTURES / f"zero{ds_stage}" / "deepspeed_run.pt", weights_only=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 1])
def test_a_deepspeed_run_resumes_in_zerospeed_like_deepspeed_continued_it(world):
    cases = [(ds, st) for ds, st, w in CASES if w == world]
    for rank_result in run_distributed(_cases, world, cases, timeout=200):
        for ds_stage, stage in cases:
            got, want = rank_result[ds_stage, stage], _expected(ds_stage)
            assert got["steps"] == 3
            assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) <= 1e-6, (
                ds_stage,
                stage,
                got["losses"],
                want["losses"][3:],
            )
            assert torch.equal(got["weights"]["scale"], torch.tensor([2.0]))
            for k, v in want["step6_fp32"].items():
                torch.testing.assert_close(
                    got["weights"][k], v, atol=1e-6, rtol=0, msg=f"ZeRO-{ds_stage} -> {stage}: {k}"
                )


def _weights_only():
    return _resume(1, 1, with_optimizer=False)


@pytest.mark.timeout(120)
def test_without_the_optimizer_states_the_continuation_differs():
    got, want = run_distributed(_weights_only, 2, timeout=100)[0], _expected(1)
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 1e-4


def test_the_universal_form_equals_deepspeeds_own_consolidation():
    """The weights read from each ZeRO 1-3 tag equal DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`
    of it (stored with the fixtures), bit for bit; the four stages' tags (the same training) agree on
    weights, moments and step; ZeRO 0's module state holds the weights whole."""
    from zerospeed.checkpoint.deepspeed_import import read_deepspeed_checkpoint

    names = [["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]]
    read = {s: read_deepspeed_checkpoint(FIXTURES / f"zero{s}" / "step3", group_names=names) for s in range(4)}
    for s in (1, 2, 3):
        assert read[s].stage == s and read[s].dp == 2
        for name, value in _expected(s)["step3_fp32"].items():
            if name == "scale":  # (a buffer: DeepSpeed's consolidation carries it, the reader keeps it in .module)
                assert torch.equal(read[s].module[name], value), s
                continue
            assert torch.equal(read[s].universal.tensors[name]["fp32"], value.reshape(-1)), (s, name)
        for name, full in read[0].universal.tensors.items():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(read[s].universal.tensors[name][key], full[key], atol=1e-7, rtol=0)
            assert float(read[s].universal.scalars[name]["step"]) == 3.0
    for name, value in read[0].module.items():
        if name != "scale":
            assert torch.equal(read[0].universal.tensors[name]["fp32"], value.reshape(-1))


def _gpt2():
    return fixture_script("make_gpt2").model()  # the 2-layer GPT-2 DeepSpeed trained


def _gpt2_batches():
    return fixture_script("make_gpt2").batches()


def _resume_gpt2(ds_stage: int, stage: int) -> list[float]:
    import zerospeed
    from zerospeed import comm

    m = _gpt2()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(str(FIXTURES / f"gpt2_zero{ds_stage}"), tag="step3")
    rank, world, losses = comm.get_rank(), comm.get_world_size(), []
    for ids in _gpt2_batches()[3:]:
        total = 0.0
        for micro in range(2):
            lo = (micro * world + rank) * 2
            loss = engine(input_ids=ids[lo : lo + 2], labels=ids[lo : lo + 2]).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / 2])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    return losses


def _gpt2_cases():
    return {(ds, st): _resume_gpt2(ds, st) for ds, st in ((2, 3), (3, 0))}


@pytest.mark.timeout(200)
def test_a_transformers_gpt2_with_a_tied_head_resumes_from_deepspeed_zero2_and_zero3():
    """A transformers GPT-2 (its head tied to the embedding) saved by DeepSpeed at ZeRO 2 and 3 resumes at
    zerospeed ZeRO 3 and 0: DeepSpeed's own losses for steps 4-6 within 1e-6."""
    import json

    got = run_distributed(_gpt2_cases, 2, timeout=160)[0]
    for (ds_stage, stage), losses in got.items():
        want = json.loads((FIXTURES / f"gpt2_zero{ds_stage}" / "losses.json").read_text())["losses"][3:]
        assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-6, (ds_stage, stage, losses, want)
