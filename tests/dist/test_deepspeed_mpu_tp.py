"""Resuming a Megatron-DeepSpeed-style run (an `mpu`, the model's own column/row-parallel layers, no AutoTP) in a
data-parallel zerospeed engine (Note [DeepSpeed mpu tensor-parallel checkpoints] in checkpoint/deepspeed_mpu_tp.py).

The fixtures `mpu_tp/{zero0_dp1, zero1_dp1, zero1_dp2}` (make_mpu_tp.py) are the tags the real DeepSpeed 0.19.8 saved
after 3 of 6 steps of make_pipe_tp.py's 8 layers in one nn.Sequential (column- / row-parallel Linears written with
plain torch.distributed, a LayerNorm, a replicated Linear) on a Megatron grid of tp 2 x dp 1 / dp 2, ZeRO 0 / 1, with
`universal_checkpoint_info` (client state) naming the row-parallel weights and the replicated parameters;
`mpu_tp/universal` is DeepSpeed's ds_to_universal of `zero1_dp2/step3`; `zero1_dp2_clip` clips the gradient norm
(0.05, acting), its split parameters marked `tensor_model_parallel` as Megatron marks them, which zerospeed's norm
reads as DeepSpeed's does. zerospeed loads them into

- the same hand-split model on zerospeed's tp group (the fixture's mpu object given to `zerospeed.initialize`),
  rank for rank and at other data-parallel sizes;
- the full model at tp 1 x dp 2;
- zerospeed's ColumnParallelLinear / RowParallelLinear cut from the same full layers at tp 2;

and trains steps 4-6: DeepSpeed's recorded losses and step-6 weights (both tp ranks joined by the patterns) within
1e-6. Without the optimizer states the losses differ (the test can fail). Saving a model whose parameters without a
zerospeed layout differ across tp ranks is refused (zerospeed would write tp rank 0's piece as the whole tensor),
and so is loading hand-split pieces from a folder that does not say how its tensors are split.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, fixture_script

ROOT = FIXTURES / "mpu_tp"
TOL = 1e-6
UNIVERSAL_OF = "zero1_dp2"  # the universal folder is DeepSpeed's conversion of this run's step3

# (fixture, model kind, tp, zerospeed's ZeRO stage) on 2 ranks; kind: "hand" (the fixture's hand-split layers),
# "full" (the plain model), "zs" (zerospeed's tensor-parallel layers)
CASES = [
    ("zero0_dp1", "hand", 2, 0),
    ("zero1_dp1", "hand", 2, 1),
    ("zero1_dp1", "hand", 2, 3),
    ("zero1_dp1", "full", 1, 2),
    ("zero0_dp1", "full", 1, 1),
    ("zero1_dp1", "zs", 2, 1),
    ("zero1_dp2", "hand", 2, 2),
    ("universal", "hand", 2, 1),
    ("universal", "zs", 2, 0),
    ("universal", "full", 1, 2),
    ("zero1_dp2_clip", "hand", 2, 1),
    ("zero1_dp2_clip", "hand", 2, 0),
    ("zero1_dp2_clip", "full", 1, 2),
    ("zero1_dp2_clip", "zs", 2, 3),
]
CASES_4 = [
    ("zero1_dp2", "hand", 2, 1),
    ("zero0_dp1", "hand", 2, 3),
    ("universal", "full", 1, 1),
    ("zero1_dp2_clip", "hand", 2, 1),
]


def _expected(fixture: str) -> dict:
    return torch.load(ROOT / (UNIVERSAL_OF if fixture == "universal" else fixture) / "deepspeed_run.pt")


def _saved_dp(fixture: str) -> int:
    return 2 if fixture.startswith("zero1_dp2") or fixture == "universal" else 1


def _model(kind: str, mpu):
    from zerospeed.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    make = fixture_script("make_mpu_tp")
    if kind == "hand":
        return make.model(mpu.tp_group, mpu.tp, mpu.tp_rank)
    layers = fixture_script("make_pipe_tp").full_layers()
    if kind in ("zs", "mixed"):  # mixed: zerospeed's column layers, the fixture's hand-split row layers
        for i in (0, 4):
            layers[i] = ColumnParallelLinear.from_linear(layers[i], group=mpu.tp_group, gather_output=False)
        for i in (2, 6):
            layers[i] = (
                RowParallelLinear.from_linear(layers[i], group=mpu.tp_group, input_is_parallel=True)
                if kind == "zs"
                else fixture_script("make_pipe_tp").RowParallel(layers[i], mpu.tp_group, mpu.tp, mpu.tp_rank)
            )
    return torch.nn.Sequential(*layers)


def _full_weights(kind: str, m, mpu) -> dict:
    import torch.distributed as dist

    from zerospeed.parallel.tensor import full_state_dict

    if kind == "zs":
        return {k: v.detach().clone() for k, v in full_state_dict(m, mpu.tp_group).items()}
    local = {k: v.detach().clone() for k, v in m.state_dict().items()}
    if kind == "full":
        return local
    states = [None] * mpu.tp
    dist.all_gather_object(states, local, group=mpu.tp_group)
    return fixture_script("make_pipe_tp").join_full(states, "")


def _resume(fixture: str, kind: str, tp: int, zero: int, with_optimizer: bool = True, save_to=None) -> dict:
    import torch.nn.functional as F

    import zerospeed
    from zerospeed import comm
    from zerospeed.checkpoint.errors import CheckpointError

    make = fixture_script("make_mpu_tp")
    mpu = make.Mpu(tp)
    m = _model(kind, mpu)
    saved_dp = _saved_dp(fixture)
    gas = 4 * saved_dp // mpu.dp  # (DeepSpeed's global batch of 8 x dp rows, 2 a micro-batch)
    clip = make.CLIP if fixture.endswith("_clip") else 0.0
    cfg = make.config(zero, gradient_accumulation_steps=gas, gradient_clipping=clip)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    universal = fixture.endswith("universal") or fixture.endswith("stripped")
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg, mpu=mpu if tp > 1 else None)
    engine.load_checkpoint(
        str(ROOT / fixture) if "/" not in fixture else fixture,
        tag=None if universal else "step3",
        load_optimizer_states=with_optimizer,
        load_lr_scheduler_states=True,
    )
    steps, d = engine.global_steps, mpu.dp_rank
    losses = []
    for x, y in make.batches(saved_dp)[3:]:
        total = 0.0
        for i in range(gas):
            lo = (i * mpu.dp + d) * 2
            loss = F.mse_loss(engine(x[lo : lo + 2]), y[lo : lo + 2])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / gas])
        comm.all_reduce(t, op="avg", group=engine.mesh.group("dp"))
        losses.append(t.item())
    if save_to is not None:
        try:
            engine.save_checkpoint(save_to, tag=kind)
            return {"losses": losses, "save_error": None}
        except (CheckpointError, NotImplementedError) as exc:
            return {"losses": losses, "save_error": f"{type(exc).__name__}: {exc}"}
    with zerospeed.zero.GatheredParameters(list(m.parameters())):
        weights = _full_weights(kind, m, mpu)
    return {"losses": losses, "steps": steps, "weights": weights}


def _cases(cases):
    return {case: _resume(*case) for case in cases}


def _check(got: dict, cases) -> None:
    for case in cases:
        result, want = got[case], _expected(case[0])
        assert result["steps"] == 3, case
        diff = max(abs(a - b) for a, b in zip(result["losses"], want["losses"][3:]))
        assert diff <= TOL, (case, result["losses"], want["losses"][3:])
        assert set(result["weights"]) == set(want["step6_weights"]), case
        for name, value in want["step6_weights"].items():
            torch.testing.assert_close(result["weights"][name], value, atol=TOL, rtol=0, msg=f"{case}: {name}")


@pytest.mark.timeout(200)
def test_a_megatron_style_mpu_run_resumes_in_zerospeed_like_deepspeed_continued_it():
    _check(run_distributed(_cases, 2, CASES, timeout=180)[0], CASES)


@pytest.mark.timeout(200)
def test_on_four_ranks_rank_for_rank_and_at_other_data_parallel_sizes():
    _check(run_distributed(_cases, 4, CASES_4, timeout=180)[0], CASES_4)


def _weights_only():
    return _resume("zero1_dp1", "hand", 2, 1, with_optimizer=False)


@pytest.mark.timeout(120)
def test_without_the_optimizer_states_the_continuation_differs_by_far_more_than_the_tolerance():
    got, want = run_distributed(_weights_only, 2, timeout=100)[0], _expected("zero1_dp1")
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 1000 * TOL


SAVES = [("zs", 1), ("mixed", 1), ("mixed", 3), ("hand", 0)]


def _saves(path: str) -> dict:
    out = {(kind, zero): _resume("zero1_dp1", kind, 2, zero, save_to=f"{path}/{kind}{zero}") for kind, zero in SAVES}
    try:  # the universal folder without its universal_checkpoint_info: the hand-split pieces cannot be cut
        _resume(f"{path}/stripped", "hand", 2, 1)
    except Exception as exc:  # noqa: BLE001 — the message is checked on the main process
        out["stripped"] = f"{type(exc).__name__}: {exc}"
    return out


def _strip_info(dst) -> None:
    from zerospeed.checkpoint.deepspeed_import import _load

    shutil.copytree(ROOT / "universal", dst)
    for path in (dst / "step3_universal").glob("mp_rank_*_model_states.pt"):
        data = _load(path)
        data.pop("universal_checkpoint_info")
        torch.save(data, dst / "new.pt")  # (not over the memory-mapped file)
        (dst / "new.pt").replace(path)


@pytest.mark.timeout(120)
def test_saving_a_model_split_by_its_own_code_is_refused_before_anything_is_written(tmp_path):
    """zerospeed's layers save (their replicated parameters are equal on both tp ranks); hand-split row layers
    beside them (at ZeRO 1 and 3: the check reads the masters each rank holds) and a wholly hand-split model are
    refused, naming the parameter. The mixed model's continuation matches DeepSpeed's too."""
    _strip_info(tmp_path / "stripped")
    got, want = run_distributed(_saves, 2, str(tmp_path), timeout=100)[0], _expected("zero1_dp1")
    stripped = got.pop("stripped")
    assert "CheckpointError" in stripped and "mp_rank_00_model_states.pt" in stripped, stripped
    assert "records no universal_checkpoint_info" in stripped and "'0.bias'" in stripped, stripped
    for case, result in got.items():
        assert max(abs(a - b) for a, b in zip(result["losses"], want["losses"][3:])) <= TOL, case
    assert got["zs", 1]["save_error"] is None and (tmp_path / "zs1" / "zs").is_dir()
    for zero in (1, 3):
        error = got["mixed", zero]["save_error"]
        assert error.startswith("CheckpointError") and "'2.weight'" in error and "split by hand" in error, error
        assert not (tmp_path / f"mixed{zero}").exists()
    assert (
        got["hand", 0]["save_error"].startswith("NotImplementedError")
        and "split by its own" in got["hand", 0]["save_error"]
    )
