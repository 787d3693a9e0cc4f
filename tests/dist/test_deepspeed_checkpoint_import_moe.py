"""Resuming a DeepSpeed MoE run in zerospeed: tags saved by DeepSpeed 0.19.8 itself from a model with one
`deepspeed.moe.layer.MoE` layer (tests/fixtures/deepspeed_0.19.8/moe_zero{S}_ep{EP}, make_moe.py: 4 experts,
top-1, no noise nor random token selection, capacity for every token; 2 ranks, after 3 of 6 steps), loaded
by `engine.load_checkpoint` (Note [DeepSpeed MoE checkpoints] in checkpoint/deepspeed_experts.py) into the
same model built with zerospeed's `MoE`, then trained for steps 4-6 on the same batches.

The reference is DeepSpeed's own continuation, recorded when the fixtures were made: its losses for steps
4-6 and every rank's weights after step 6, experts under their global names. Each tag resumes at its own ep
and stage, and at another ep / ZeRO stage / world size: losses and weights agree within 1e-6, so dense
weights, experts (each global expert on the rank that holds it at the loading ep), Adam moments and step,
the LR schedule and counters came across. The reader's weights equal DeepSpeed's recorded step-3 weights
exactly; a tag whose experts are swapped gives other losses (the test can fail).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, fixture_script

make_moe = fixture_script("make_moe")  # the model, batches and loss DeepSpeed trained

# (fixture, zerospeed's ZeRO stage, zerospeed's ep size, zerospeed's ranks)
CASES = [
    ("moe_zero0_ep2", 0, 2, 2),
    ("moe_zero2_ep2", 2, 2, 2),
    ("moe_zero2_ep2", 1, 1, 2),
    ("moe_zero1_ep2", 3, 2, 2),
    ("moe_zero2_ep1", 2, 2, 2),
    ("moe_zero0_ep2", 2, 1, 1),
    ("moe_zero2_ep1", 0, 1, 1),
]


def _resume(where, ds_stage: int, stage: int, ep: int) -> dict:
    import zerospeed
    from zerospeed import comm
    from zerospeed.moe.layer import MoE
    from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    world, rank = comm.get_world_size(), comm.get_rank()
    gas = 4 // world
    m = make_moe.moe_model(MoE, ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()), "name": "params"})
    cfg = make_moe.config(stage, make_moe.clipping(ds_stage)) | {"gradient_accumulation_steps": gas}
    engine, *_ = zerospeed.initialize(model=m, model_parameters=groups, config=cfg)
    engine.load_checkpoint(str(where), tag="step3")
    steps = engine.global_steps
    step = fixture_script("make").train_step
    losses = [step(engine, make_moe.step_loss(engine, x, y), rank, world, gas) for x, y in make_moe.moe_batches()[3:]]
    with zerospeed.zero.GatheredParameters(list(m.parameters())):
        weights = make_moe.global_weights(m, comm.get_rank(m.moe.deepspeed_moe.ep_group), ep)
    return {"losses": losses, "weights": weights, "steps": steps}


def _cases(cases):
    return {(f, s, ep): _resume(FIXTURES / f, _ds_stage(f), s, ep) for f, s, ep in cases}


def _ds_stage(fixture: str) -> int:
    return int(fixture.split("_")[1][len("zero") :])


def _expected(fixture: str) -> dict:
    return torch.load(FIXTURES / fixture / "deepspeed_run.pt", weights_only=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 1])
def test_a_deepspeed_moe_run_resumes_in_zerospeed_like_deepspeed_continued_it(world):
    cases = [(f, s, ep) for f, s, ep, w in CASES if w == world]
    bad = []
    for rank_result in run_distributed(_cases, world, cases, timeout=260):
        for case in cases:
            got, want = rank_result[case], _expected(case[0])
            assert got["steps"] == 3
            loss = max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:]))
            # this rank's dense weights and its own experts
            weight = max(float((v - want["step6_weights"][k]).abs().max()) for k, v in got["weights"].items())
            if max(loss, weight) > 1e-6:
                bad.append((case, loss, weight, got["losses"], want["losses"][3:]))
    assert not bad, bad


def _swapped(tmp):
    return _resume(tmp, 2, 2, 2)


@pytest.mark.timeout(120)
def test_experts_in_the_wrong_places_give_another_continuation(tmp_path):
    """Experts 0 and 3 swapped in DeepSpeed's files (expert files and optimizer partitions alike): the
    reader must put each expert where DeepSpeed had it, so the swap shows in the losses."""
    from zerospeed.checkpoint.deepspeed_import import _load

    src = FIXTURES / "moe_zero2_ep1" / "step3"
    dst = tmp_path / "step3"
    shutil.copytree(src, dst)
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    for a, b in ((0, 3), (3, 0)):
        sd = torch.load(src / f"layer_0_expert_{a}_mp_rank_00_model_states.pt", weights_only=True)
        torch.save(
            {k.replace(f"{prefix}{a}.", f"{prefix}{b}."): v for k, v in sd.items()},
            dst / f"layer_0_expert_{b}_mp_rank_00_model_states.pt",
        )
    for r in (0, 1):  # rank 0 holds half of every expert at ep 1 / edp 2: swap the fragments' names
        path = dst / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        sd = _load(src / path.name)  # (DeepSpeed's pickled classes as plain records, saved back as such)
        mappings = sd["optimizer_state_dict"]["param_slice_mappings"][1]
        swap = {
            f"{prefix}0.": f"{prefix}3.",
            f"{prefix}3.": f"{prefix}0.",
            f"{prefix}1.": f"{prefix}2.",
            f"{prefix}2.": f"{prefix}1.",
        }
        renamed = {}
        for k, v in mappings.items():
            for old, new in swap.items():
                if k.startswith(old):
                    k = new + k[len(old) :]
                    break
            renamed[k] = v
        sd["optimizer_state_dict"]["param_slice_mappings"][1] = renamed
        torch.save(sd, path)
    got = run_distributed(_swapped, 2, tmp_path, timeout=100)[0]
    want = _expected("moe_zero2_ep1")
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 1e-5


def test_the_reader_gives_deepspeeds_step3_weights_under_global_names():
    """Every fixture, read into the universal form, holds DeepSpeed's weights after step 3 (recorded by each
    rank, experts under their global names) exactly, and its ep size; the ZeRO-1/2 tags at ep 2 and 1 agree
    on the moments (each expert's wherever its ep rank wrote it)."""
    from zerospeed.checkpoint.deepspeed_experts import read_deepspeed_moe_checkpoint

    dense = ["fc1.weight", "fc1.bias", "moe.deepspeed_moe.gate.wg.weight", "fc2.weight", "fc2.bias"]
    expert = [f"moe.deepspeed_moe.experts.deepspeed_experts.{j}.0.{w}" for j in range(2) for w in ("weight", "bias")]
    read = {}
    for fixture, ep in (("moe_zero0_ep2", 2), ("moe_zero1_ep2", 2), ("moe_zero2_ep2", 2), ("moe_zero2_ep1", 1)):
        ckpt = read_deepspeed_moe_checkpoint(FIXTURES / fixture / "step3", group_names=[dense, expert])
        assert ckpt.meta["ep_size"] == ep and ckpt.dp == 2
        want = _expected(fixture)["step3_weights"]
        assert set(ckpt.universal.tensors) == set(want), fixture
        for name, value in want.items():
            assert torch.equal(ckpt.universal.tensors[name]["fp32"], value.reshape(-1)), (fixture, name)
            assert float(ckpt.universal.scalars[name]["step"]) == 3.0
        read[fixture] = ckpt
    # (the ZeRO-0 tag is of another run: trained without gradient clipping, make_moe.clipping)
    for name, full in read["moe_zero2_ep2"].universal.tensors.items():
        for other in ("moe_zero1_ep2", "moe_zero2_ep1"):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(read[other].universal.tensors[name][key], full[key], atol=1e-7, rtol=0)


def _through_zerospeed(tmp):
    """DeepSpeed's ep-2 ZeRO-2 tag loaded at zerospeed ZeRO 1 and ep 1, saved by zerospeed as it is."""
    import zerospeed
    from zerospeed.moe.layer import MoE
    from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    m = make_moe.moe_model(MoE, 1)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()), "name": "params"})
    engine, *_ = zerospeed.initialize(model=m, model_parameters=groups, config=make_moe.config(1, 1.0))
    engine.load_checkpoint(str(FIXTURES / "moe_zero2_ep2"), tag="step3")
    engine.save_checkpoint(str(tmp), tag="step3")


@pytest.mark.timeout(120)
def test_zerospeed_ckpt_export_gives_deepspeeds_moe_files_back(tmp_path):
    """A DeepSpeed MoE tag taken through zerospeed (loaded at ZeRO 1, ep 1; saved) and `zerospeed-ckpt export
    --to deepspeed --stage 2 --dp 2 --ep 2` gives DeepSpeed's own files back: expert files, weights, the
    optimizer partitions, moments and fragment maps value for value (the recorded config aside)."""
    from harness.deepspeed_files import assert_same_contents
    from zerospeed.checkpoint.cli import main
    from zerospeed.checkpoint.deepspeed_import import _load

    run_distributed(_through_zerospeed, 2, tmp_path / "zs", timeout=100)
    argv = [str(tmp_path / "zs"), str(tmp_path / "ds"), "--to", "deepspeed", "--stage", "2", "--dp", "2", "--ep", "2"]
    assert main(["export", *argv]) == 0
    src, out = FIXTURES / "moe_zero2_ep2" / "step3", tmp_path / "ds" / "step3"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    for name in sorted(p.name for p in src.iterdir()):
        mine, theirs = _load(out / name), _load(src / name)
        if name.startswith("layer_"):
            assert_same_contents(mine, theirs, name)
        elif name.startswith("zero_pp"):
            assert_same_contents(mine["optimizer_state_dict"], theirs["optimizer_state_dict"], name)
        else:
            for key in ("module", "param_shapes", "num_experts", "global_steps", "global_samples", "dp_world_size"):
                assert_same_contents(mine[key], theirs[key], f"{name}[{key}]")
