"""DeepSpeed's universal folder of a pipeline run with a tied layer, loaded by zerospeed's PipelineEngine with
`checkpoint.load_universal: true` (Note [DeepSpeed pipeline universal folders] in checkpoint/deepspeed_pipeline.py).

The fixture (make_pipe_universal.py, run by the real DeepSpeed 0.19.8): DeepSpeed's own `ds_to_universal
--inject_missing_state` of `pipe_tied_zero1/step3` (pp 2 x dp 2, ZeRO 1, gradient_clipping 1.0, a tied `Linear(4, 4)`
first and again last through a `forward_fn`), and `deepspeed_run.pt`: the 3 losses and final weights of DeepSpeed's
PipelineEngine that loaded that folder with `checkpoint.load_universal: true` and trained steps 4-6. zerospeed loads
the folder at 2 stages and 1 stage, data-parallel 1 and 2, ZeRO 0 and 1, trains the same steps on the same samples
and gives DeepSpeed's losses and weights within 1e-6. A data-parallel engine refuses the folder by name.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_pipeline_continuation, continue_tied_pipeline, fixture_script

MICRO = 2
MAKE = fixture_script("make_pipe_tied")  # the model and batches DeepSpeed trained
FOLDER = FIXTURES / "pipe_universal"


def _config(zero: int, gas: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": zero},
        "gradient_clipping": 1.0,
        "checkpoint": {"load_universal": True},
    }


def _resume(pp: int, zero: int, gas: int, with_optimizer: bool = True):
    import zerospeed
    from zerospeed import comm
    from zerospeed.pipe import PipelineModule, TiedLayerSpec

    torch.manual_seed(1)  # other initial weights than DeepSpeed's: the load must bring them
    net = PipelineModule(
        layers=MAKE.layers(TiedLayerSpec), num_stages=pp, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=_config(zero, gas))
    path, _ = engine.load_checkpoint(str(FOLDER), load_optimizer_states=with_optimizer)  # tag: latest_universal
    assert path is not None and path.endswith("step3_universal")
    dp = comm.get_world_size(engine.dp_group)
    assert dp * gas * MICRO == 16  # DeepSpeed's global batch (dp 2 x 4 micro-batches of 2)
    steps = engine.global_steps
    losses, weights = continue_tied_pipeline(engine, net, MAKE.batches(2), gas, MICRO)
    return {"losses": losses, "steps": steps, "weights": weights}


# (world, pp, zero stage, gradient accumulation): DeepSpeed's layout, then other stage counts / dp sizes / stages
CASES = [(4, 2, 1, 4), (2, 2, 0, 8), (2, 1, 1, 4), (1, 1, 0, 8)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,pp,zero,gas", CASES)
def test_deepspeeds_pipeline_universal_folder_resumes_in_zerospeeds_pipeline_engine(world, pp, zero, gas):
    results = run_distributed(_resume, world, pp, zero, gas, timeout=200)
    assert_pipeline_continuation(results, FOLDER / "deepspeed_run.pt", first=0)  # (the run recorded steps 4-6 only)


@pytest.mark.timeout(180)
def test_without_its_optimizer_states_the_universal_continuation_differs():
    got = run_distributed(_resume, 1, 1, 0, 8, False, timeout=150)[0]
    want = torch.load(FOLDER / "deepspeed_run.pt", weights_only=True)
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) > 1e-4


def _data_parallel_load():
    import zerospeed
    from zerospeed.checkpoint.errors import CheckpointError

    net = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 8))
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=_config(1, 8))
    try:
        engine.load_checkpoint(str(FOLDER))
    except CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_a_data_parallel_engine_refuses_a_pipeline_universal_folder_by_name():
    message = run_distributed(_data_parallel_load, 1, timeout=100)[0]
    assert message is not None and "step3_universal" in message and "PipelineModule" in message, message


# ---- export: a zerospeed pipeline checkpoint as DeepSpeed's pipeline universal folder ----------------------


def _load_tag_and_save(out: str) -> None:
    import zerospeed
    from zerospeed.pipe import PipelineModule, TiedLayerSpec

    net = PipelineModule(
        layers=MAKE.layers(TiedLayerSpec), num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    cfg = {**_config(0, 4), "checkpoint": {}}
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(str(FIXTURES / "pipe_tied_zero1"), tag="step3")
    engine.save_checkpoint(out, tag="step3")


def _hyper(groups: list[dict]) -> list[dict]:
    return [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "params")} for g in groups]


@pytest.mark.timeout(240)
def test_an_exported_pipeline_universal_folder_holds_what_deepspeeds_converter_wrote(tmp_path):
    from harness.deepspeed_files import assert_same_contents
    from zerospeed.checkpoint.cli import main
    from zerospeed.checkpoint.deepspeed_import import _load

    run_distributed(_load_tag_and_save, 4, str(tmp_path / "zs"), timeout=150)  # DeepSpeed's layout: pp 2 x dp 2
    assert main(["export", str(tmp_path / "zs"), str(tmp_path / "uni"), "--to", "universal", "--dp", "2"]) == 0
    assert (tmp_path / "uni" / "latest_universal").read_text() == "step3_universal"
    mine, theirs = tmp_path / "uni" / "step3_universal", FOLDER / "step3_universal"
    keys = ("module", "buffer_names", "optimizer", "param_shapes", "lr_scheduler", "skipped_steps", "global_steps")
    keys += ("global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions")
    for s in range(2):
        a, b = _load(mine / f"mp_rank_{s:02d}_model_states.pt"), _load(theirs / f"mp_rank_{s:02d}_model_states.pt")
        assert_same_contents({k: a[k] for k in keys}, {k: b[k] for k in keys}, f"stage {s}")
    folders = sorted(p.relative_to(theirs) for p in theirs.glob("zero/*/*.pt"))
    assert folders and sorted(p.relative_to(mine) for p in mine.glob("zero/*/*.pt")) == folders
    for rel in folders:
        a, b = _load(mine / rel), _load(theirs / rel)
        if isinstance(b, dict):
            a, b = a["param"], b["param"].detach()
        assert_same_contents(a, b, str(rel))
    a, b = _load(mine / "zero" / "optimizer_state.pt"), _load(theirs / "zero" / "optimizer_state.pt")
    a["param_groups"], b["param_groups"] = _hyper(a["param_groups"]), _hyper(b["param_groups"])
    a.pop("ds_version"), b.pop("ds_version")
    assert_same_contents(a, b, "zero/optimizer_state.pt")
