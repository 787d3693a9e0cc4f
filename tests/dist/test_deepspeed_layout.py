"""ZeRO 1-3 tags saved with `checkpoint.deepspeed_layout` (Notes [as-saved DeepSpeed layout] and [as-saved ZeRO 1/2]
in checkpoint/deepspeed_layout.py) hold what DeepSpeed 0.19.8's loader reads, without writing any value twice.

The reference is the fixture DeepSpeed itself saved (tests/fixtures/deepspeed_0.19.8/zero3/step3, make.py): zerospeed
trains the same run (the same model, config and batches, ZeRO 3 on 2 ranks) for the same 3 steps and saves with the
key. Every rank's optimizer file then has DeepSpeed's `optimizer_state_dict` with the keys, shapes and dtypes of
DeepSpeed's own file and its values within 1e-6 (the two runs trained alike), and its model-states file the keys
DeepSpeed's file has; zerospeed's own entries are the same storages (one copy in the file). zerospeed resumes the
tag (at ZeRO 3 on 2 ranks and at ZeRO 1 on one) like DeepSpeed continued its run (losses within 1e-6). That the real
DeepSpeed resumes such a tag is checked by `benchmarks/deepspeed_differential.py --export --as-saved`
(docs/checkpoints.md has its numbers). ZeRO 1 and 2 alike against the fixtures zero1/zero2: DeepSpeed's rank files'
`optimizer_state_dict` (the fp32 slices, the torch optimizer's state over the padded slice, paddings, fragment
addresses) and model states, and the tag's payload written once (the file's storages are DeepSpeed's tensors);
zerospeed resumes it at its stage on 2 ranks and at ZeRO 3 on one like DeepSpeed continued (losses within 1e-6).
ZeRO 0 against the fixture zero0 (Note [as-saved ZeRO 0]): the model states' `optimizer` is DeepSpeed's torch-optimizer
state_dict (its keys, numbering, shapes, hyperparameters and values within 1e-6), zerospeed's entries are the same
tensors (the file's storages are the weights and that state, once), and zerospeed resumes the tag at ZeRO 0-3 on 2 ranks
and at ZeRO 0 and 2 on one like DeepSpeed continued (losses, and the step-6 weights DeepSpeed recorded, within 1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, continue_fixture_run, fixture_model


def _config(stage: int, gas: int, as_saved: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"deepspeed_layout": as_saved},
    }


def _save(folder: str, stage: int = 3) -> None:
    import zerospeed

    m = fixture_model(2.0)
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, 2, True))
    continue_fixture_run(engine, m, 2, steps=slice(0, 3))
    engine.save_checkpoint(folder, tag="step3")


def _resume(folder: str, stage: int) -> list[float]:
    import zerospeed
    from zerospeed import comm

    gas = 4 // comm.get_world_size()
    m = fixture_model()
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, gas))
    engine.load_checkpoint(folder, tag="step3")
    assert torch.equal(m.scale, torch.tensor([2.0]))
    return continue_fixture_run(engine, m, gas)


def _assert_close_tree(mine, theirs, where: str) -> None:
    """Tensors of the same dtype and shape within 1e-6; dicts with the same keys; lists alike."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype, where
        assert mine.shape == theirs.shape, f"{where}: {tuple(mine.shape)} != {tuple(theirs.shape)}"
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0, msg=where)
    elif isinstance(theirs, dict):
        assert sorted(map(str, mine)) == sorted(map(str, theirs)), f"{where}: {list(mine)} != {list(theirs)}"
        for k in theirs:
            _assert_close_tree(mine[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs)):
            _assert_close_tree(a, b, f"{where}[{i}]")


def _optim_files(tag, stage: int):
    """Rank by rank: (rank, zerospeed's optim file, DeepSpeed's of the fixture `zero{stage}/step3`, the two
    `optimizer_state_dict`s), after checking that ours holds every key of DeepSpeed's, in its order."""
    from zerospeed.checkpoint.deepspeed_import import _load

    ds_tag = FIXTURES / f"zero{stage}" / "step3"
    for r in range(2):
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        mine, theirs = _load(tag / name), _load(ds_tag / name)
        assert set(theirs) <= set(mine), sorted(set(theirs) - set(mine))
        osd, ds_osd = mine["optimizer_state_dict"], theirs["optimizer_state_dict"]
        assert list(osd) == list(ds_osd)
        yield r, mine, theirs, osd, ds_osd


def _check_files(tag) -> None:
    from zerospeed.checkpoint.deepspeed_import import _load

    ds_tag = FIXTURES / "zero3" / "step3"
    for r, mine, theirs, osd, ds_osd in _optim_files(tag, 3):
        _assert_close_tree(osd["fp32_flat_groups"], ds_osd["fp32_flat_groups"], f"rank {r} fp32_flat_groups")
        _assert_close_tree(osd["optimizer_state_dict"]["state"], ds_osd["optimizer_state_dict"]["state"], f"rank {r}")
        for mine_g, ds_g in zip(
            osd["optimizer_state_dict"]["param_groups"], ds_osd["optimizer_state_dict"]["param_groups"]
        ):
            assert mine_g["params"] == ds_g["params"] and mine_g["lr"] == pytest.approx(ds_g["lr"], abs=1e-12)
        assert osd["partition_count"] == ds_osd["partition_count"] == 2
        assert int(osd["zero_stage"]) == int(ds_osd["zero_stage"]) == 3
        assert osd["loss_scaler"].cur_scale == ds_osd["loss_scaler"].cur_scale
        # zerospeed's entries are DeepSpeed's tensors: one storage each in the file
        for entry, flat, state in zip(
            mine["entries"], osd["fp32_flat_groups"], osd["optimizer_state_dict"]["state"].values()
        ):
            assert entry["master"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            for k in ("exp_avg", "exp_avg_sq"):
                assert entry["state"][k].untyped_storage().data_ptr() == state[k].untyped_storage().data_ptr()
        model = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        mine, theirs = _load(tag / model), _load(ds_tag / model)
        assert set(theirs) - {"zero_to_fp32.py"} <= set(mine), sorted(set(theirs) - set(mine))
        assert list(mine["module"]) == list(theirs["module"])
        for k, v in theirs["module"].items():
            assert mine["module"][k].shape == v.shape and mine["module"][k].dtype == v.dtype, k
        assert [dict(g) for g in mine["param_shapes"]] == [dict(g) for g in theirs["param_shapes"]]
        assert mine["global_steps"] == theirs["global_steps"] == 3


@pytest.mark.timeout(300)
def test_a_stage3_tag_saved_as_deepspeed_lays_it_out_loads_like_deepspeeds_own(tmp_path):
    run_distributed(_save, 2, str(tmp_path), timeout=150)
    _check_files(tmp_path / "step3")
    want = torch.load(FIXTURES / "zero3" / "deepspeed_run.pt", weights_only=True)["losses"][3:]
    got = {2: run_distributed(_resume, 2, str(tmp_path), 3, timeout=120)[0]}
    got[1] = run_distributed(_resume, 1, str(tmp_path), 1, timeout=120)[0]
    for world, losses in got.items():
        assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-6, (world, losses, want)


def _refused(folder: str) -> list[str]:
    import zerospeed

    messages = []
    for stage, extra in (
        (0, {"bf16": {"enabled": True}}),
        (2, {"bf16": {"enabled": True}}),
        (3, {"bf16": {"enabled": True}}),
    ):
        m = fixture_model(2.0)
        cfg = {**_config(stage, 2, True), **extra}
        engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        try:
            engine.save_checkpoint(folder, tag="t")
            messages.append("")
        except Exception as exc:  # noqa: BLE001
            messages.append(str(exc))
    return messages


def _refused_fp16_stage0(folder: str) -> str:
    import zerospeed
    from zerospeed.utils.errors import ConfigError

    m = fixture_model(2.0)
    cfg = {**_config(0, 2, True), "fp16": {"enabled": True}}
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    with pytest.raises(ConfigError) as info:
        engine.save_checkpoint(folder, tag="t")
    return str(info.value)


@pytest.mark.timeout(120)
def test_with_bf16_the_key_is_refused_with_the_export_named_and_fp16_at_stage_0_with_the_key(tmp_path):
    messages = run_distributed(_refused, 2, str(tmp_path), timeout=100)[0]
    assert len(messages) == 3
    for message in messages:
        assert "checkpoint.deepspeed_layout" in message and "zerospeed-ckpt export" in message, message
    message = run_distributed(_refused_fp16_stage0, 1, str(tmp_path / "fp16"), timeout=100)[0]
    assert "checkpoint.deepspeed_layout" in message and "fp16.enabled" in message, message
    assert not (tmp_path / "fp16" / "t").exists()


def _storages_bytes(path) -> int:
    """Bytes of the tensor storages torch.save wrote into `path` (each distinct storage is one zip record)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        return sum(i.file_size for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl"))


def _unique_bytes(obj) -> int:
    seen = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            seen[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sum(seen.values())


def _check_stage12_files(tag, stage: int) -> None:
    from zerospeed.checkpoint.deepspeed_import import _load

    ds_tag = FIXTURES / f"zero{stage}" / "step3"
    for r, mine, _theirs, osd, ds_osd in _optim_files(tag, stage):
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        fp32 = osd["single_partition_of_fp32_groups"]
        _assert_close_tree(fp32, ds_osd["single_partition_of_fp32_groups"], f"rank {r} fp32")
        base, ds_base = osd["base_optimizer_state"], ds_osd["base_optimizer_state"]
        _assert_close_tree(base["state"], ds_base["state"], f"rank {r} base_optimizer_state")
        for mine_g, ds_g in zip(base["param_groups"], ds_base["param_groups"], strict=True):
            assert mine_g["params"] == ds_g["params"] and mine_g["lr"] == pytest.approx(ds_g["lr"], abs=1e-12)
        for key in ("group_paddings", "param_alignment_paddings", "partition_count", "ds_version", "clip_grad"):
            assert osd[key] == ds_osd[key], key
        for key in ("dynamic_loss_scale", "overflow"):
            assert osd[key] == ds_osd[key], key
        assert [list(g) for g in osd["param_slice_mappings"]] == [list(g) for g in ds_osd["param_slice_mappings"]]
        for g, ds_g in zip(osd["param_slice_mappings"], ds_osd["param_slice_mappings"]):
            assert [(a.numel, a.start) for a in g.values()] == [(a.numel, a.start) for a in ds_g.values()]
        assert int(osd["zero_stage"]) == int(ds_osd["zero_stage"]) == stage
        assert osd["loss_scaler"].cur_scale == ds_osd["loss_scaler"].cur_scale
        # zerospeed's entries are DeepSpeed's tensors (views of its padded state): one storage each in the file
        (entry,) = mine["entries"]
        state = base["state"][0]
        assert entry["master"].untyped_storage().data_ptr() == fp32[0].untyped_storage().data_ptr()
        for k in ("exp_avg", "exp_avg_sq"):
            assert entry["state"][k].untyped_storage().data_ptr() == state[k].untyped_storage().data_ptr()
            assert entry["state"][k].numel() == fp32[0].numel()
        # ... so the file's storages are the optimizer_state_dict's and the header's (the RNG states), nothing more
        assert _storages_bytes(tag / name) == _unique_bytes(osd) + _unique_bytes(mine["rng"])
    model = "mp_rank_00_model_states.pt"
    mine, theirs = _load(tag / model), _load(ds_tag / model)
    read = ("module", "lr_scheduler", "global_steps", "skipped_steps", "dp_world_size", "mp_world_size", "param_shapes")
    assert set(read) <= set(mine), sorted(set(read) - set(mine))
    _assert_close_tree(dict(mine["module"]), dict(theirs["module"]), "module")
    assert [dict(g) for g in mine["param_shapes"]] == [dict(g) for g in theirs["param_shapes"]]
    assert mine["global_steps"] == theirs["global_steps"] == 3 and mine["dp_world_size"] == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_stage_1_or_2_tag_saved_as_deepspeed_lays_it_out_loads_like_deepspeeds_own(tmp_path, stage):
    run_distributed(_save, 2, str(tmp_path), stage, timeout=150)
    _check_stage12_files(tmp_path / "step3", stage)
    want = torch.load(FIXTURES / f"zero{stage}" / "deepspeed_run.pt", weights_only=True)["losses"][3:]
    got = {(2, stage): run_distributed(_resume, 2, str(tmp_path), stage, timeout=120)[0]}
    got[(1, 3)] = run_distributed(_resume, 1, str(tmp_path), 3, timeout=120)[0]
    for where, losses in got.items():
        assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-6, (where, losses, want)


def _resume_stages(folder: str, stages: list[int]) -> dict:
    """The tag resumed at each ZeRO stage on this world: the losses of steps 4-6 and the step-6 weights."""
    import zerospeed
    from zerospeed import comm

    out = {}
    for stage in stages:
        gas = 4 // comm.get_world_size()
        m = fixture_model()
        engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, gas))
        engine.load_checkpoint(folder, tag="step3")
        assert engine.global_steps == 3 and torch.equal(m.scale, torch.tensor([2.0]))
        losses = continue_fixture_run(engine, m, gas)
        with zerospeed.zero.GatheredParameters(list(m.parameters())):
            weights = {k: v.detach().clone() for k, v in m.state_dict().items()}
        out[stage] = {"losses": losses, "weights": weights}
    return out


def _check_stage0_files(tag) -> None:
    import json

    from zerospeed.checkpoint.deepspeed_import import _load

    model = "mp_rank_00_model_states.pt"
    mine, theirs = _load(tag / model), _load(FIXTURES / "zero0" / "step3" / model)
    read = ("module", "optimizer", "lr_scheduler", "global_steps", "skipped_steps", "dp_world_size", "mp_world_size")
    assert set(read) <= set(mine), sorted(set(read) - set(mine))
    _assert_close_tree(dict(mine["module"]), dict(theirs["module"]), "module")
    osd, ds_osd = mine["optimizer"], theirs["optimizer"]
    assert list(osd) == list(ds_osd) == ["state", "param_groups"]
    _assert_close_tree(osd["state"], ds_osd["state"], "optimizer state")  # (keys by DeepSpeed's numbering)
    assert [list(s) for s in osd["state"].values()] == [list(s) for s in ds_osd["state"].values()]
    for g, ds_g in zip(osd["param_groups"], ds_osd["param_groups"], strict=True):
        assert list(g) == list(ds_g) and g["params"] == ds_g["params"], (g, ds_g)
        assert g["lr"] == pytest.approx(ds_g["lr"], abs=1e-12)
        assert {k: v for k, v in g.items() if k != "lr"} == {k: v for k, v in ds_g.items() if k != "lr"}
    assert mine["lr_scheduler"] == theirs["lr_scheduler"]
    for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size"):
        assert mine[key] == theirs[key], key
    # zerospeed's entries are those tensors: the weights and DeepSpeed's state, one storage each in the file
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    by_ptr = {ptr(t): k for k, t in mine["module"].items()}
    names = [by_ptr[ptr(e["master"])] for e in mine["entries"]]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    for entry, state in zip(mine["entries"], osd["state"].values()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert ptr(entry["state"][k]) == ptr(state[k])
    assert _storages_bytes(tag / model) == _unique_bytes(dict(mine["module"])) + _unique_bytes(osd)
    manifest = json.loads((tag / "zerospeed_manifest.json").read_text())
    assert [(rf["rank"], rf["file"], len(rf["entries"])) for rf in manifest["partition"]] == [
        (0, model, 6),
        (1, "zero_pp_rank_1_mp_rank_00_optim_states.pt", 0),
    ]
    for r in range(2):  # the rank files keep each rank's RNG state, no entries
        rank_file = _load(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        assert rank_file["entries"] == [] and "rng" in rank_file


@pytest.mark.timeout(300)
def test_a_stage_0_tag_saved_as_deepspeed_lays_it_out_loads_like_deepspeeds_own(tmp_path):
    run_distributed(_save, 2, str(tmp_path), 0, timeout=150)
    _check_stage0_files(tmp_path / "step3")
    want = torch.load(FIXTURES / "zero0" / "deepspeed_run.pt", weights_only=True)
    got = {
        (2, s): r for s, r in run_distributed(_resume_stages, 2, str(tmp_path), [0, 1, 2, 3], timeout=200)[0].items()
    }
    got.update(
        {(1, s): r for s, r in run_distributed(_resume_stages, 1, str(tmp_path), [0, 2], timeout=150)[0].items()}
    )
    for where, r in got.items():
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"][3:])) <= 1e-6, (where, r["losses"])
        for k, v in want["step6_fp32"].items():
            torch.testing.assert_close(r["weights"][k], v, atol=1e-6, rtol=0, msg=f"{where}: {k}")


def _model_states_fail_on_rank_0(folder: str) -> dict:
    import zerospeed
    from zerospeed import comm
    from zerospeed.checkpoint import save as save_module

    m = fixture_model(2.0)
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=_config(3, 2, True))
    continue_fixture_run(engine, m, 2, steps=slice(0, 3))
    engine.save_checkpoint(folder, tag="step3")
    if comm.get_rank() == 0:  # a fault where only the model-states writer goes, before the collective layout
        real = save_module._model_states

        def broken(*args, **kwargs):
            raise OSError("injected: model states unavailable")

        save_module._model_states = broken
    try:
        engine.save_checkpoint(folder, tag="bad")
        error = None
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    finally:
        if comm.get_rank() == 0:
            save_module._model_states = real
    return {"error": error, "latest": (Path(folder) / "latest").read_text().strip()}


@pytest.mark.timeout(120)
def test_a_rank_failing_before_the_collective_layout_fails_the_save_on_every_rank_without_a_hang(tmp_path):
    """With the key on, the model-states writer failing before `_as_saved`'s all-gathers still joins them: every
    rank raises (naming rank 0 and the cause) instead of the others waiting forever, and `latest` stays."""
    for r in run_distributed(_model_states_fail_on_rank_0, 2, str(tmp_path), timeout=90):
        assert r["error"] is not None and "rank 0" in r["error"] and "injected" in r["error"], r
        assert r["latest"] == "step3"
