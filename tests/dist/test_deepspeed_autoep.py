"""zerospeed's AutoEP trains as the real DeepSpeed's AutoEP does, at ZeRO 2 and ZeRO 3, and resumes DeepSpeed's
AutoEP ZeRO-3 tag (Note [DeepSpeed AutoEP ZeRO-3 checkpoints] in checkpoint/deepspeed_autoep.py).

DeepSpeed 0.19.8 trains MoE at ZeRO 3 only through AutoEP (its native `MoE` is refused there). Fixtures
autoep_zero{2,3}_ep2 (make_autoep.py) recorded DeepSpeed's mean loss of each of 6 steps of a tiny Mixtral
under `"expert_parallel": {"enabled": true, "autoep_size": 2, "preset_model": "mixtral"}` on 2 gloo ranks
(AdamW, WarmupLR, 2 accumulation steps). zerospeed builds the same model from the same seed and trains it
with the same config and batches: every step's loss agrees within 1e-6. The recorded losses move away
from the untrained model's (checked), so the weight updates are compared too, not only the forward.

Resume: autoep_zero3_ep2's `step3` tag loads through `engine.load_checkpoint` into the same model under
zerospeed's AutoEP at ZeRO 3 / 2 / 1 and ep 2 / 1; steps 4-6 give DeepSpeed's recorded losses within 1e-6
(measured: equal). So does the ZeRO-2 tag autoep_zero2_ep2 (Note [DeepSpeed AutoEP ZeRO-1/2 checkpoints]),
resumed at ZeRO 2 ep 2, ZeRO 3 ep 1 and ZeRO 1 ep 2.
The test can fail: without the stacked experts' global offsets in the load (rank 1 at ep 2
then took experts 0-1 for its 2-3), step 4 was off by 1.6e-5.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, fixture_script

pytest.importorskip("transformers")
make_autoep = fixture_script("make_autoep")  # DeepSpeed's model, batches and config


def _train(cases: list[tuple[int, int]], resume: str | None) -> dict[tuple[int, int], list[float]]:
    """Per (ZeRO stage, ep): the mean loss of each step, from scratch (6 steps) or resumed from fixture `resume`'s
    step 3."""
    import zerospeed
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    out = {}
    for stage, ep in cases:
        m = make_autoep.mixtral()
        cfg = make_autoep.config(stage, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": "mixtral"})
        eng, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        if resume:
            eng.load_checkpoint(str(FIXTURES / resume), tag="step3")
        losses = []
        for ids in make_autoep.batches(world)[3 if resume else 0 :]:
            tot = 0.0
            for micro in range(2):  # make.train_step's rows: rank r's micro-batch m is rows (m * world + r) * 2, +2
                lo = (micro * world + rank) * 2
                loss = eng(input_ids=ids[lo : lo + 2], labels=ids[lo : lo + 2]).loss
                eng.backward(loss)
                eng.step()
                tot += loss.item()
            mean = torch.tensor([tot / 2])
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        out[(stage, ep)] = losses
    return out


@pytest.mark.timeout(240)
def test_autoep_trains_like_deepspeeds_autoep():
    ours = run_distributed(_train, 2, [(2, 2), (3, 2)], None, timeout=200)[0]
    m = make_autoep.mixtral()
    with torch.no_grad():
        untrained = [
            sum(m(input_ids=b[i : i + 2], labels=b[i : i + 2]).loss.item() for i in range(0, 8, 2)) / 4
            for b in make_autoep.batches()
        ]
    for stage in (2, 3):
        theirs = torch.load(FIXTURES / f"autoep_zero{stage}_ep2" / "deepspeed_run.pt")["losses"]
        assert max(abs(a - b) for a, b in zip(untrained[3:], theirs[3:])) > 1e-3  # training moved the weights
        for step, (a, b) in enumerate(zip(ours[(stage, 2)], theirs, strict=True)):
            assert abs(a - b) <= 1e-6, f"ZeRO {stage}, step {step + 1}: zerospeed {a} vs DeepSpeed {b}"


# (fixture, its ranks = zerospeed's ranks, zerospeed's (ZeRO stage, ep) cases)
RESUME = [
    ("autoep_zero3_ep2", 2, [(3, 2), (2, 2), (1, 1), (3, 1)]),
    ("autoep_zero3_ep2_dp4", 4, [(3, 2), (2, 4)]),  # DeepSpeed's expert-data-parallel groups of 2 ranks
    ("autoep_zero2_ep2", 2, [(2, 2), (3, 1), (1, 2)]),  # ZeRO-1/2 flat partitions (deepspeed_autoep_zero12.py)
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fixture,world,cases", RESUME, ids=[r[0] for r in RESUME])
def test_resume_deepspeeds_autoep_tag(fixture, world, cases):
    theirs = torch.load(FIXTURES / fixture / "deepspeed_run.pt")["losses"][3:]
    ours = run_distributed(_train, world, cases, fixture, timeout=200)[0]
    for case in cases:
        for step, (a, b) in enumerate(zip(ours[case], theirs, strict=True)):
            assert abs(a - b) <= 1e-6, f"ZeRO {case[0]}, ep {case[1]}, step {step + 4}: zerospeed {a} vs DeepSpeed {b}"
