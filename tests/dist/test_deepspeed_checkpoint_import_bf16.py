"""Resuming a DeepSpeed bf16 run in zerospeed (Note [DeepSpeed's bf16 files] in checkpoint/deepspeed_import.py).

The fixtures `bf16_zero{1,2,3}` (make_bf16.py) are tags the real DeepSpeed 0.19.8 saved after 3 of 6 steps
of the fixture MLP with `bf16.enabled` on 2 ranks: at ZeRO 1 with its BF16_Optimizer, at ZeRO 2 and 3 with
its ZeRO optimizers, all as `bf16_zero_pp_rank_*` files; `deepspeed_run.pt` holds DeepSpeed's losses of the
6 steps and its fp32 masters after steps 3 and 6 (DeepSpeed's `safe_get_full_fp32_param`, recorded in the run;
its `zero_to_fp32.py` does not read BF16_Optimizer files).

- The universal form read from each tag equals DeepSpeed's step-3 masters bit for bit (no process).
- zerospeed (bf16, another ZeRO stage) resumes each tag and trains steps 4-6. Step 4's loss is the loaded
  bf16 weights' forward, the same ops in both libraries: within 1e-6 (measured: 0). Steps 5 and 6 follow
  updates whose gradients the two libraries sum in another order and, where the accumulation dtype is bf16,
  round at other points; a last-bit difference in a gradient can round a bf16 weight the other way, so
  they agree to bf16's noise: BF16_TOLERANCE (measured: at most 2.5e-4 on losses near 1; 0 where the
  accumulation dtype matches DeepSpeed's and the stage does too). The fp32 masters after step 6
  (`safe_get_full_fp32_param` in both) agree within BF16_WEIGHT_TOLERANCE (measured: at most 7.7e-5).
  DeepSpeed 0.19.8 accumulates bf16 gradients in bf16 unless `data_types.grad_accum_dtype` says otherwise
  (its BF16_Optimizer fixture sets "fp32"); each case resumes with the run's own accumulation dtype, and
  one across them.
- Without the optimizer states the continuation differs from DeepSpeed's by far more than the tolerance
  (measured: 8.3e-2; so the tolerance cannot hide a lost Adam state).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, continue_fixture_run, fixture_model

NAMES = [["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]]
BF16_TOLERANCE = 1e-3  # |Δ loss| at steps 5-6 (losses near 1)
BF16_WEIGHT_TOLERANCE = 5e-4  # |Δ| of the fp32 masters after step 6 (weights below 1)
# (DeepSpeed's stage, zerospeed's stage, zerospeed's grad_accum_dtype) on 2 ranks
CASES = [(1, 2, "fp32"), (2, 3, "bf16"), (3, 2, "bf16"), (2, 1, "fp32")]


def model():
    return fixture_model()


def _expected(ds_stage: int) -> dict:
    return torch.load(FIXTURES / f"bf16_zero{ds_stage}" / "deepspeed_run.pt", weights_only=True)


def _resume(ds_stage: int, stage: int, with_optimizer: bool = True, accumulate: str = "fp32") -> dict:
    import zerospeed

    m = model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": accumulate},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(
        str(FIXTURES / f"bf16_zero{ds_stage}"),
        tag="step3",
        load_optimizer_states=with_optimizer,
        load_lr_scheduler_states=with_optimizer,
    )
    steps = engine.global_steps
    losses = continue_fixture_run(engine, m, 2, dtype=torch.bfloat16)
    from zerospeed.zero.tensor_access import safe_get_full_fp32_param

    masters = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in m.named_parameters()}
    return {"losses": losses, "steps": steps, "scale": m.scale.detach().clone(), "masters": masters}


def _cases(cases):
    return {(ds, stage, acc): _resume(ds, stage, accumulate=acc) for ds, stage, acc in cases}


def test_the_universal_form_equals_deepspeeds_own_masters_of_its_bf16_tags():
    from zerospeed.checkpoint.deepspeed_import import read_deepspeed_checkpoint

    read = {}
    for s in (1, 2, 3):
        tag_dir = FIXTURES / f"bf16_zero{s}" / "step3"
        assert any(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt")), tag_dir
        read[s] = read_deepspeed_checkpoint(tag_dir, group_names=NAMES)
        assert read[s].stage == s and read[s].dp == 2
        for name, value in _expected(s)["step3_fp32"].items():
            if name == "scale":
                assert torch.equal(read[s].module[name].float(), value.float()), s
                continue
            assert torch.equal(read[s].universal.tensors[name]["fp32"], value.reshape(-1)), (s, name)
        for name in NAMES[0]:
            assert float(read[s].universal.scalars[name]["step"]) == 3.0
            assert set(read[s].universal.tensors[name]) == {"fp32", "exp_avg", "exp_avg_sq"}
    # the three runs are the same bf16 training: their Adam moments agree to bf16 noise, not to zero
    for name in NAMES[0]:
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = read[1].universal.tensors[name][key], read[2].universal.tensors[name][key]
            torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


@pytest.mark.timeout(240)
def test_a_deepspeed_bf16_run_resumes_in_zerospeed_like_deepspeed_continued_it():
    got = run_distributed(_cases, 2, CASES, timeout=200)[0]
    for ds_stage, stage, accumulate in CASES:
        result, want = got[ds_stage, stage, accumulate], _expected(ds_stage)
        assert result["steps"] == 3
        assert torch.equal(result["scale"].float(), torch.tensor([2.0]))
        first, *rest = (abs(a - b) for a, b in zip(result["losses"], want["losses"][3:]))
        assert first <= 1e-6, (ds_stage, stage, result["losses"], want["losses"][3:])
        assert max(rest) <= BF16_TOLERANCE, (ds_stage, stage, accumulate, result["losses"], want["losses"][3:])
        for k, v in want["step6_fp32"].items():
            if k != "scale":
                torch.testing.assert_close(
                    result["masters"][k], v, atol=BF16_WEIGHT_TOLERANCE, rtol=0, msg=f"{ds_stage} -> {stage}: {k}"
                )


def _weights_only():
    return _resume(1, 1, with_optimizer=False)


@pytest.mark.timeout(120)
def test_without_the_optimizer_states_the_bf16_continuation_differs_by_more_than_the_tolerance():
    got, want = run_distributed(_weights_only, 2, timeout=100)[0], _expected(1)
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 20 * BF16_TOLERANCE
