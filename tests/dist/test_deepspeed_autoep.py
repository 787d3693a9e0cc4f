"""zerospeed's AutoEP trains as the real DeepSpeed's AutoEP does, at ZeRO 2 and ZeRO 3, and resumes DeepSpeed's
AutoEP tags at ZeRO 0-3, fp32 and bf16 (Note [DeepSpeed AutoEP ZeRO-3 checkpoints] in checkpoint/deepspeed_autoep.py).

DeepSpeed 0.19.8 trains MoE at ZeRO 3 only through AutoEP (its native `MoE` is refused there). Fixtures
autoep_zero{2,3}_ep2 (make_autoep.py) recorded DeepSpeed's mean loss of each of 6 steps of a tiny Mixtral
under `"expert_parallel": {"enabled": true, "autoep_size": 2, "preset_model": "mixtral"}` on 2 gloo ranks
(AdamW, WarmupLR, 2 accumulation steps). zerospeed builds the same model from the same seed and trains it
with the same config and batches: every step's loss agrees within 1e-6. The recorded losses move away
from the untrained model's (checked), so the weight updates are compared too, not only the forward.

Resume: autoep_zero3_ep2's `step3` tag loads through `engine.load_checkpoint` into the same model under
zerospeed's AutoEP at ZeRO 3 / 2 / 1 and ep 2 / 1; steps 4-6 give DeepSpeed's recorded losses within 1e-6
(measured: equal). So does the ZeRO-2 tag autoep_zero2_ep2 (Note [DeepSpeed AutoEP ZeRO-1/2 checkpoints]),
resumed at ZeRO 2 ep 2, ZeRO 3 ep 1 and ZeRO 1 ep 2; DeepSpeed's ZeRO-1 tag autoep_zero1_ep2 (the same files)
at ZeRO 1 ep 2 and ZeRO 2 ep 1; its ZeRO-0 tag autoep_zero0_ep2 (Note [DeepSpeed AutoEP ZeRO-0 checkpoints]:
expp_rank_* optimizer files, layer_0_expert_e weights) at ZeRO 0 ep 2, ZeRO 2 ep 2 and ZeRO 3 ep 1 (measured:
equal; DeepSpeed's own fp32 losses are the same at ZeRO 0, 1 and 2).
The test can fail: without the stacked experts' global offsets in the load (rank 1 at ep 2
then took experts 0-1 for its 2-3), step 4 was off by 1.6e-5; with the ZeRO-0 expert moments taken in the order
w2, w1, w3 instead of GroupedExperts' w1, w2, w3 (the shapes are the same here), step 5 was off by 5.2e-6.

bf16 (autoep_zero{2,3,1}_ep2_bf16, `make_autoep.py --bf16`: the same run with `"bf16": {"enabled": true}`, and
DeepSpeed's own step-3 fp32 masters from `safe_get_full_fp32_param`): the masters read equal DeepSpeed's bit for
bit, and so do the masters zerospeed's engine holds right after the load, at ZeRO 2 ep 2, ZeRO 3 ep 2 and ZeRO 1
ep 1. Step 4 is the loaded bf16 weights' forward: within 1e-6 (measured: 2.4e-7, one fp32 ulp at 3.46; 0 from
the ZeRO-1 tag). Steps 5
and 6 follow bf16 gradients that the two libraries form and sum in another order (zerospeed's AutoEP trained from
scratch in bf16 is already 2.4e-7 off DeepSpeed's at step 3 and 8.5e-5 at step 5): BF16_TOLERANCE = 1e-4
(measured at most 3.1e-5; without the optimizer states the continuation is 1.9e-3 off, checked > 10x the
tolerance, so the tolerance cannot hide a lost Adam state).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, fixture_script

pytest.importorskip("transformers")
make_autoep = fixture_script("make_autoep")  # DeepSpeed's model, batches and config


def _train(cases: list[tuple[int, int]], resume: str | None, bf16: str | None = None, optimizer: bool = True) -> dict:
    """Per (ZeRO stage, ep): the mean loss of each step, from scratch (6 steps) or resumed from fixture `resume`'s
    step 3 (with its optimizer states unless `optimizer` is False); `bf16`: train in bf16, accumulating gradients
    in that dtype ("bf16" or "fp32"), and record under ("loaded", stage, ep) this rank's fp32 masters right after
    the load (`safe_get_full_fp32_param`)."""
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero.tensor_access import safe_get_full_fp32_param

    rank, world = comm.get_rank(), comm.get_world_size()
    out = {}
    for stage, ep in cases:
        m = make_autoep.mixtral()
        cfg = make_autoep.config(stage, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": "mixtral"})
        if bf16:
            cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": bf16})
        eng, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        if resume:
            eng.load_checkpoint(
                str(FIXTURES / resume), tag="step3", load_optimizer_states=optimizer, load_lr_scheduler_states=optimizer
            )
            if bf16:
                masters = {n: safe_get_full_fp32_param(p) for n, p in m.named_parameters()}
                out[("loaded", stage, ep)] = {n: v.detach().clone() for n, v in masters.items() if v is not None}
        losses = []
        for ids in make_autoep.batches(world)[
            3 if resume else 0 :
        ]:  # rank r's micro-batch m: rows (m * world + r) * 2, +2
            losses.append(make_autoep.train_step(eng, make_autoep.loss_of(eng, ids), rank, world))
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
    ("autoep_zero1_ep2", 2, [(1, 2), (2, 1)]),  # (DeepSpeed's ZeRO-1 tag: the ZeRO-1/2 files)
    ("autoep_zero0_ep2", 2, [(0, 2), (2, 2), (3, 1)]),  # expp_rank_* + expert files (deepspeed_autoep_zero0.py)
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fixture,world,cases", RESUME, ids=[r[0] for r in RESUME])
def test_resume_deepspeeds_autoep_tag(fixture, world, cases):
    theirs = torch.load(FIXTURES / fixture / "deepspeed_run.pt")["losses"][3:]
    ours = run_distributed(_train, world, cases, fixture, timeout=200)[0]
    for case in cases:
        for step, (a, b) in enumerate(zip(ours[case], theirs, strict=True)):
            assert abs(a - b) <= 1e-6, f"ZeRO {case[0]}, ep {case[1]}, step {step + 4}: zerospeed {a} vs DeepSpeed {b}"


def test_the_zero0_and_zero1_tags_go_to_their_readers():
    """DeepSpeed's ZeRO-0 AutoEP tag (expp_rank_* optimizer files, layer_0_expert_e files) and its ZeRO-1 one (the
    ZeRO-1/2 files) are each recognised as AutoEP; the dense and native-MoE readers refuse them naming the reader."""
    from zerospeed.checkpoint.deepspeed_autoep_zero0 import (
        is_deepspeed_autoep_zero0_tag,
        read_deepspeed_autoep_zero0_checkpoint,
    )
    from zerospeed.checkpoint.deepspeed_autoep_zero12 import is_deepspeed_autoep_zero12_tag
    from zerospeed.checkpoint.deepspeed_experts import read_deepspeed_moe_checkpoint
    from zerospeed.checkpoint.deepspeed_import import read_deepspeed_checkpoint
    from zerospeed.checkpoint.errors import CheckpointError

    zero0, zero1 = (FIXTURES / f"autoep_zero{s}_ep2" / "step3" for s in (0, 1))
    assert is_deepspeed_autoep_zero0_tag(zero0) and not is_deepspeed_autoep_zero12_tag(zero0)
    assert is_deepspeed_autoep_zero12_tag(zero1) and not is_deepspeed_autoep_zero0_tag(zero1)
    for read in (read_deepspeed_checkpoint, read_deepspeed_moe_checkpoint):
        with pytest.raises(CheckpointError, match="at ZeRO 0 is read by deepspeed_autoep_zero0"):
            read(zero0)
    ckpt = read_deepspeed_autoep_zero0_checkpoint(zero0)
    assert (ckpt.stage, ckpt.dp, ckpt.meta["ep_size"], ckpt.meta["global_steps"]) == (0, 2, 2, 3)
    assert ckpt.layout["shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 16, 8)
    assert ckpt.layout["group_names"][1] == [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ]


# ---- bf16 AutoEP tags (make_autoep.py --bf16) ----

BF16_FIXTURES = ["autoep_zero2_ep2_bf16", "autoep_zero3_ep2_bf16", "autoep_zero1_ep2_bf16"]  # DeepSpeed's ZeRO 2, 3, 1
# |Δ loss| at steps 5-6 after a bf16 resume (losses near 3.46): see the module docstring's bf16 paragraph
BF16_TOLERANCE = 1e-4
BF16_CASES = [(2, 2), (3, 2), (1, 1)]  # zerospeed's (ZeRO stage, ep), gradients accumulated in bf16 as DeepSpeed's


def _deepspeed_masters(fixture: str, ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's own step-3 fp32 masters (`safe_get_full_fp32_param` in the run, each rank's local experts)
    under transformers' names, the experts of `ep_rank` at `ep` (the fixture's rank r held experts 2r, 2r + 1)."""
    record = torch.load(FIXTURES / fixture / "deepspeed_run.pt")["step3_full"]
    prefix = "model.layers.0.mlp."
    out = {n.replace("mlp.router.gate.", "mlp.gate."): v for n, v in record[0].items() if ".experts." not in n}
    whole = {w: torch.cat([r[f"{prefix}experts.{w}"] for r in record]) for w in ("w1", "w2", "w3")}
    rows = slice(ep_rank * 4 // ep, (ep_rank + 1) * 4 // ep)
    out[prefix + "experts.gate_up_proj"] = torch.cat([whole["w1"], whole["w3"]], dim=1)[rows]
    out[prefix + "experts.down_proj"] = whole["w2"][rows]
    return out


def test_bf16_tags_read_deepspeeds_own_fp32_masters_exactly():
    """The fp32 masters read from a bf16 tag's bf16_zero_pp_rank_* files equal the ones DeepSpeed's own
    `safe_get_full_fp32_param` gave in the run (bit for bit), at ZeRO 2, 3 and 1; the Adam moments read from the
    ZeRO-2 tag's flat partitions equal those read from the ZeRO-3 tag's per-parameter pieces (the same bf16 run:
    DeepSpeed's ZeRO 2 and 3 give it the same masters, checked here too; its ZeRO-1 run parts from them at step 4)."""
    from zerospeed.checkpoint.deepspeed_autoep import read_deepspeed_autoep_zero3_checkpoint
    from zerospeed.checkpoint.deepspeed_autoep_zero12 import read_deepspeed_autoep_zero12_checkpoint
    from zerospeed.checkpoint.deepspeed_import import _load

    read = {
        2: read_deepspeed_autoep_zero12_checkpoint(FIXTURES / BF16_FIXTURES[0] / "step3"),
        3: read_deepspeed_autoep_zero3_checkpoint(FIXTURES / BF16_FIXTURES[1] / "step3"),
        1: read_deepspeed_autoep_zero12_checkpoint(FIXTURES / BF16_FIXTURES[2] / "step3"),
    }
    for stage, fixture in zip((2, 3, 1), BF16_FIXTURES, strict=True):
        ckpt, want = read[stage], _deepspeed_masters(fixture, 1, 0)
        assert ckpt.meta["ds_config"]["bf16"]["enabled"] and ckpt.meta["global_steps"] == 3
        assert sorted(ckpt.universal.tensors) == sorted(want)
        for name, value in want.items():
            assert torch.equal(ckpt.universal.tensors[name]["fp32"], value.reshape(-1)), (stage, name)
            assert float(ckpt.universal.scalars[name]["step"]) == 3.0
    tag = FIXTURES / BF16_FIXTURES[0] / "step3"  # the bf16 weights DeepSpeed saved are the masters rounded
    for name, value in _load(tag / "mp_rank_00_model_states.pt")["module"].items():
        if ".gate.gate." not in name:  # (DeepSpeed's alias of the router)
            ours = read[2].universal.tensors[name.replace("router.gate", "gate")]["fp32"]
            assert value.dtype == torch.bfloat16 and torch.equal(ours.view(value.shape).bfloat16(), value), name
    for e in range(4):
        saved = _load(tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")["model.layers.0.mlp.experts.w2." + str(e)]
        ours = read[2].universal.tensors["model.layers.0.mlp.experts.down_proj"]["fp32"].view(4, 8, 8)[e]
        assert torch.equal(ours.bfloat16(), saved), e
    for name, value in read[2].universal.tensors.items():
        assert set(value) == {"fp32", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(value[key], read[3].universal.tensors[name][key]), (name, key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fixture", BF16_FIXTURES)
def test_resume_deepspeeds_bf16_autoep_tag(fixture):
    theirs = torch.load(FIXTURES / fixture / "deepspeed_run.pt")["losses"][3:]
    results = run_distributed(_train, 2, BF16_CASES, fixture, "bf16", timeout=200)
    for stage, ep in BF16_CASES:
        for rank, result in enumerate(results):  # the masters right after the load: DeepSpeed's, exactly
            want = _deepspeed_masters(fixture, ep, rank % ep)
            got = result[("loaded", stage, ep)]
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                assert torch.equal(got[name], value), f"ZeRO {stage}, ep {ep}, rank {rank}: {name}"
        first, *rest = (abs(a - b) for a, b in zip(results[0][(stage, ep)], theirs, strict=True))
        assert first <= 1e-6, f"ZeRO {stage}, ep {ep}, step 4: {results[0][(stage, ep)]} vs DeepSpeed {theirs}"
        assert max(rest) <= BF16_TOLERANCE, f"ZeRO {stage}, ep {ep}: {results[0][(stage, ep)]} vs DeepSpeed {theirs}"


@pytest.mark.timeout(120)
def test_without_the_optimizer_states_the_bf16_continuation_differs_by_more_than_the_tolerance():
    theirs = torch.load(FIXTURES / BF16_FIXTURES[0] / "deepspeed_run.pt")["losses"][3:]
    ours = run_distributed(_train, 2, [(2, 2)], BF16_FIXTURES[0], "bf16", False, timeout=100)[0][(2, 2)]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) > 10 * BF16_TOLERANCE
