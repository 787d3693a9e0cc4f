"""Resuming a DeepSpeed AutoTP run in zerospeed (Note [DeepSpeed tensor-parallel checkpoints] in
checkpoint/deepspeed_tp.py).

The fixtures `tp_autotp/zero{0,1}` (make_tp.py) are tags the real DeepSpeed 0.19.8 saved after 3 of 6 steps
of a tiny transformers Llama trained with `tensor_parallel.autotp_size: 2` on 2 ranks (tp 2 x dp 1), ZeRO 0
and 1, AdamW, WarmupLR, gradient clipping; `deepspeed_run.pt` holds DeepSpeed's 6 losses and its full weights
after steps 3 and 6 (DeepSpeed's own consolidation of the tp shards).

- The full tensors read from each tag equal DeepSpeed's consolidated step-3 weights bit for bit, by the
  affine map DeepSpeed records and by its name categories alike (no process).
- zerospeed resumes each tag with its own AutoTP at tp 2, and at tp 1 x dp 2, at ZeRO 0-3, and trains steps
  4-6: losses within 1e-6 of DeepSpeed's and the weights after step 6 within 1e-6 of DeepSpeed's.
- DeepSpeed's own universal folder of the ZeRO-1 tag (`tp_universal`, its `ds_to_universal`) loads with
  `checkpoint.load_universal` at tp 2 and at tp 1 x dp 2, continuing as DeepSpeed's own universal load did
  (within 1e-6).
- Without the optimizer states the continuation differs by far more than that (so the test sees Adam's state).
- A tensor-parallel tag that does not record how its parameters are split is refused, naming the file.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, fixture_script

pytest.importorskip("transformers")

ROOT = FIXTURES / "tp_autotp"
UNIVERSAL = FIXTURES / "tp_universal"  # DeepSpeed's ds_to_universal of tp_autotp/zero1/step3 (make_tp_universal.py)
TOL = 1e-6
# (DeepSpeed's stage, zerospeed's stage, zerospeed's tp) on 2 ranks
CASES = [(0, 0, 2), (1, 1, 2), (1, 3, 2), (0, 2, 1), (1, 1, 1)]
UNIVERSAL_CASES = [("universal", 1, 2), ("universal", 2, 1)]


MAKE = fixture_script("make_tp")  # the tiny Llama and the batches DeepSpeed trained
model, batches = MAKE.model, MAKE.batches


def _expected(stage: int) -> dict:
    return torch.load(ROOT / f"zero{stage}" / "deepspeed_run.pt", weights_only=True)


def _names() -> list[list[str]]:
    return [[n for n, _ in model().named_parameters()]]


def _config(stage: int, tp: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4 // (2 // tp),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _resume(ds_stage, stage: int, tp: int, with_optimizer: bool = True) -> dict:
    """`ds_stage`: a tag of tp_autotp (0, 1), or "universal" (DeepSpeed's universal folder of the ZeRO-1 tag)."""
    import zerospeed

    m = model()
    cfg = _config(stage, tp)
    if ds_stage == "universal":
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(
        str(UNIVERSAL if ds_stage == "universal" else ROOT / f"zero{ds_stage}"),
        tag=None if ds_stage == "universal" else "step3",
        load_optimizer_states=with_optimizer,
        load_lr_scheduler_states=with_optimizer,
    )
    steps = engine.global_steps
    return {"steps": steps, **_continue(engine, m, tp, lambda mine: engine(input_ids=mine, labels=mine).loss)}


def _continue(engine, m, tp: int, loss_of) -> dict:
    """Steps 4-6 of the fixtures' batches (make_tp.py's, the same in make_tp_fused.py), each dp rank its rows: the
    dp-mean losses and the full weights after."""
    import zerospeed
    from zerospeed import comm
    from zerospeed.parallel.tensor import full_state_dict

    dp_rank, micro = engine.mesh.rank_in("dp"), 4 // engine.mesh.size("dp")
    losses = []
    for ids in batches()[3:]:
        loss = loss_of(ids[dp_rank * micro : (dp_rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        comm.all_reduce(t, op="avg", group=engine.mesh.group("dp"))
        losses.append(t.item())
    with zerospeed.zero.GatheredParameters(list(m.parameters())):
        weights = full_state_dict(m, engine.mesh.group("tp")) if tp > 1 else dict(m.state_dict())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in weights.items()}}


def _cases(cases):
    return {case: _resume(*case) for case in cases}


def test_the_full_tensors_equal_deepspeeds_own_consolidation_of_its_tp_shards():
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.deepspeed_tp import join, read_deepspeed_tp_checkpoint

    read = {}
    for s in (0, 1):
        tag_dir = ROOT / f"zero{s}" / "step3"
        read[s] = ckpt = read_deepspeed_tp_checkpoint(tag_dir, group_names=_names())
        assert ckpt.dp == 1 and ckpt.meta["tp"] == 2 and ckpt.meta["global_steps"] == 3
        want = _expected(s)["step3"]
        assert set(ckpt.universal.tensors) == set(want)
        for name, value in want.items():
            assert torch.equal(ckpt.universal.tensors[name]["fp32"], value.reshape(-1)), (s, name)
            assert ckpt.layout["shapes"][name] == tuple(value.shape)
            assert set(ckpt.universal.tensors[name]) == {"fp32", "exp_avg", "exp_avg_sq"}
            assert float(ckpt.universal.scalars[name]["step"]) == 3.0
        # the name categories (what DeepSpeed wrote before its affine maps) give the same tensors
        info = dict(_load(tag_dir / "mp_rank_00_model_states.pt")["universal_checkpoint_info"])
        info.pop("affine_map")
        shards = [_load(tag_dir / f"mp_rank_{t:02d}_model_states.pt")["module"] for t in (0, 1)]
        for name, value in want.items():
            assert torch.equal(join(info, name, [sh[name] for sh in shards], "fp32", tag_dir), value), name
    # ZeRO 0 and ZeRO 1 ran the same training: the same Adam moments
    for name in read[0].universal.tensors:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(read[0].universal.tensors[name][key], read[1].universal.tensors[name][key])


@pytest.mark.timeout(300)
def test_a_deepspeed_autotp_run_resumes_in_zerospeed_at_tp_2_and_tp_1_like_deepspeed_continued_it():
    got = run_distributed(_cases, 2, CASES, timeout=270)[0]
    for ds_stage, stage, tp in CASES:
        result, want = got[ds_stage, stage, tp], _expected(ds_stage)
        assert result["steps"] == 3
        diff = max(abs(a - b) for a, b in zip(result["losses"], want["losses"][3:]))
        assert diff <= TOL, (ds_stage, stage, tp, result["losses"], want["losses"][3:])
        for name, value in want["step6"].items():
            torch.testing.assert_close(
                result["weights"][name].float(), value, atol=TOL, rtol=0, msg=f"{ds_stage} -> {stage} tp {tp}: {name}"
            )


def _weights_only():
    return _resume(1, 1, 2, with_optimizer=False)


@pytest.mark.timeout(120)
def test_without_the_optimizer_states_the_continuation_differs_by_far_more_than_the_tolerance():
    got, want = run_distributed(_weights_only, 2, timeout=100)[0], _expected(1)
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 1000 * TOL


def test_a_tensor_parallel_tag_without_its_split_recorded_is_refused_naming_the_file(tmp_path):
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.deepspeed_tp import read_deepspeed_tp_checkpoint
    from zerospeed.checkpoint.errors import CheckpointError

    tag = tmp_path / "step3"
    shutil.copytree(ROOT / "zero0" / "step3", tag)
    for t in (0, 1):
        path = tag / f"mp_rank_{t:02d}_model_states.pt"
        data = _load(path)
        data.pop("universal_checkpoint_info")
        torch.save(data, tmp_path / "new.pt")  # (not over the memory-mapped file)
        (tmp_path / "new.pt").replace(path)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt.*without universal_checkpoint_info"):
        read_deepspeed_tp_checkpoint(tag, group_names=_names())


def _compare_with_deepspeeds_files(out, tag_dir, where: str, skip: tuple[str, ...] = ()) -> None:
    """Every file DeepSpeed wrote, with the same contents (`universal_checkpoint_info`: the same categories; the
    export writes no affine map, which DeepSpeed's converter does not need); top-level keys `skip` left out."""
    from harness.deepspeed_files import assert_same_contents
    from zerospeed.checkpoint.deepspeed_import import _load

    theirs_files = sorted(p.name for p in tag_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == theirs_files, where
    for name in theirs_files:
        mine, theirs = _load(out / name), _load(tag_dir / name)
        for key in skip:
            mine.pop(key), theirs.pop(key)
        if "model_states" in name:
            info = dict(theirs.pop("universal_checkpoint_info"))
            info.pop("affine_map")
            assert mine.pop("universal_checkpoint_info") == info, (where, name)
        assert_same_contents(mine, theirs, f"{where}: {name}")


@pytest.mark.parametrize("fixture, stage", [("tp_autotp/zero0", 0), ("tp_autotp/zero1", 1), ("tp_fused/zero1", 1)])
def test_the_tp_export_rewrites_deepspeeds_own_autotp_files(tmp_path, fixture, stage):
    """tp_fused: DeepSpeed's sub-parameter split of the fused qkv_proj (parameter_with_sub_params) too."""
    from zerospeed.checkpoint.deepspeed_export import source_from_deepspeed
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.deepspeed_tp import read_deepspeed_tp_checkpoint
    from zerospeed.checkpoint.deepspeed_tp_export import splits_from_deepspeed, write_deepspeed_tp_tag

    tag_dir = FIXTURES / fixture / "step3"
    names = _fused_names() if "fused" in fixture else _names()
    ckpt = read_deepspeed_tp_checkpoint(tag_dir, group_names=names)
    info = _load(tag_dir / "mp_rank_00_model_states.pt")["universal_checkpoint_info"]
    splits = splits_from_deepspeed(info, ckpt.layout["shapes"])
    out = write_deepspeed_tp_tag(source_from_deepspeed(ckpt), splits, tmp_path, "step3", stage=stage, dp=1, tp=2)
    assert (tmp_path / "latest").read_text() == "step3"
    _compare_with_deepspeeds_files(out, tag_dir, fixture)


def _load_save_export(engine, tag_root, folder: str) -> None:
    """Resume DeepSpeed's `step3` tag under `tag_root`, save it at once as zerospeed's checkpoint, and (rank 0)
    export that with --tp 2 through the CLI into `folder/ds`."""
    from zerospeed import comm
    from zerospeed.checkpoint.cli import main

    engine.load_checkpoint(str(tag_root), tag="step3")
    engine.save_checkpoint(f"{folder}/zs", tag="step3")
    comm.barrier()
    if comm.get_rank() == 0:
        argv = [f"{folder}/zs", f"{folder}/ds", "--to", "deepspeed", "--stage", "1", "--dp", "1", "--tp", "2"]
        assert main(["export", *argv]) == 0


def _resume_save_export(folder: str) -> None:
    """zerospeed (its own AutoTP, tp 2, ZeRO 1) resumes DeepSpeed's ZeRO-1 tag and saves it at once as its own
    checkpoint; rank 0 exports that with --tp 2 (the CLI)."""
    import zerospeed

    m = model()
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=_config(1, 2))
    _load_save_export(engine, ROOT / "zero1", folder)


@pytest.mark.timeout(120)
def test_a_zerospeed_tp_checkpoint_exports_as_the_files_deepspeed_wrote(tmp_path):
    """DeepSpeed's ZeRO-1 AutoTP tag, resumed by zerospeed's AutoTP (which also splits the embedding), saved in
    zerospeed's layout and exported with `--tp 2`, is DeepSpeed's own tag again, file for file."""
    run_distributed(_resume_save_export, 2, str(tmp_path), timeout=100)
    # (the recorded ds_config is zerospeed's resolved config, every key spelled out)
    ds_step3 = ROOT / "zero1" / "step3"
    _compare_with_deepspeeds_files(tmp_path / "ds" / "step3", ds_step3, "zerospeed -> zero1", skip=("ds_config",))


@pytest.mark.timeout(120)
def test_deepspeeds_universal_folder_of_an_autotp_run_loads_at_tp_2_and_tp_1_like_deepspeed_loaded_it():
    import json

    want = json.loads((UNIVERSAL / "losses.json").read_text())["losses"]
    got = run_distributed(_cases, 2, UNIVERSAL_CASES, timeout=100)[0]
    for case in UNIVERSAL_CASES:
        assert got[case]["steps"] == 3
        assert max(abs(a - b) for a, b in zip(got[case]["losses"], want)) <= TOL, (case, got[case]["losses"], want)


def _resume_gpt2_at_tp2() -> list[float]:
    """make_gpt2.py's data-parallel ZeRO-2 tag (2 ranks, 2 accumulation steps of 2 sequences) under zerospeed's
    AutoTP at tp 2 x dp 1: 4 accumulation steps of the same 2-sequence micro-batches."""
    import json

    import zerospeed

    m = fixture_script("make_gpt2").model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(str(FIXTURES / "gpt2_zero2"), tag="step3")
    losses = []
    for ids in fixture_script("make_gpt2").batches()[3:]:
        total = 0.0
        for lo in (0, 2, 4, 6):  # (DeepSpeed's order: micro-batch m of rank r holds sequences (2m + r) * 2 ..)
            loss = engine(input_ids=ids[lo : lo + 2], labels=ids[lo : lo + 2]).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / 4)
    want = json.loads((FIXTURES / "gpt2_zero2" / "losses.json").read_text())["losses"][3:]
    return [losses, want]


@pytest.mark.timeout(120)
def test_a_data_parallel_deepspeed_tag_resumes_under_zerospeeds_autotp():
    """DeepSpeed's tp-1 GPT-2 tag (fused Conv1D c_attn stored [in, out], head tied to the embedding) loads into
    zerospeed's AutoTP at tp 2: each rank cuts its pieces of the full tensors (before, this was refused)."""
    losses, want = run_distributed(_resume_gpt2_at_tp2, 2, timeout=100)[0]
    assert max(abs(a - b) for a, b in zip(losses, want)) <= TOL, (losses, want)


# ---- a fused q|k|v weight (tp_fused, make_tp_fused.py): DeepSpeed's affine map has three pieces per rank ----

FUSED = FIXTURES / "tp_fused" / "zero1"
FUSED_MAKE = fixture_script("make_tp_fused")
FUSED_SPECS, Fused = FUSED_MAKE.SPECS, FUSED_MAKE.Fused  # make_tp_fused.py's layer specs and model


def _fused_names() -> list[list[str]]:
    return [[n for n, _ in Fused().named_parameters()]]


def test_a_fused_qkv_weight_is_rebuilt_from_deepspeeds_affine_map_and_refused_without_one(tmp_path):
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.deepspeed_tp import join, read_deepspeed_tp_checkpoint
    from zerospeed.checkpoint.errors import CheckpointError

    tag_dir = FUSED / "step3"
    ckpt = read_deepspeed_tp_checkpoint(tag_dir, group_names=_fused_names())
    want = torch.load(FUSED / "deepspeed_run.pt", weights_only=True)["step3"]
    for name, value in want.items():
        assert torch.equal(ckpt.universal.tensors[name]["fp32"], value.reshape(-1)), name
    # rank 0 holds q[0:8] | k[0:8] | v[0:8]: not the first half of the fused rows
    shard = _load(tag_dir / "mp_rank_00_model_states.pt")["module"]["qkv_proj.weight"]
    assert torch.equal(shard, torch.cat([want["qkv_proj.weight"][i : i + 8] for i in (0, 16, 32)]))
    info = dict(_load(tag_dir / "mp_rank_00_model_states.pt")["universal_checkpoint_info"])
    info.pop("affine_map")
    shards = [_load(tag_dir / f"mp_rank_{t:02d}_model_states.pt")["module"]["qkv_proj.weight"] for t in (0, 1)]
    with pytest.raises(CheckpointError, match="qkv_proj.weight is a fused parameter"):
        join(info, "qkv_proj.weight", shards, "fp32", tag_dir)


def _fused_resume(tp: int, stage: int) -> dict:
    import zerospeed

    m = Fused()
    cfg = {
        "train_micro_batch_size_per_gpu": 4 // (2 // tp),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {
            "autotp_size": tp,
            "partition_config": {"use_default_specs": False, "layer_specs": FUSED_SPECS},
        }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(str(FUSED), tag="step3")
    return _continue(engine, m, tp, engine)


def _fused_cases():
    return {(tp, stage): _fused_resume(tp, stage) for tp, stage in ((2, 1), (1, 2))}


@pytest.mark.timeout(120)
def test_a_deepspeed_tag_with_a_fused_qkv_weight_resumes_at_tp_2_and_tp_1():
    got = run_distributed(_fused_cases, 2, timeout=100)[0]
    want = torch.load(FUSED / "deepspeed_run.pt", weights_only=True)
    for case, result in got.items():
        assert max(abs(a - b) for a, b in zip(result["losses"], want["losses"][3:])) <= TOL, (case, result["losses"])
        for name, value in want["step6"].items():
            torch.testing.assert_close(result["weights"][name], value, atol=TOL, rtol=0, msg=f"{case}: {name}")


def _fused_resume_save_export(folder: str) -> None:
    """zerospeed's AutoTP (tp 2, ZeRO 1, the same partition_config) resumes tp_fused, saves, and exports --tp 2."""
    import zerospeed

    m = Fused()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {
            "autotp_size": 2,
            "partition_config": {"use_default_specs": False, "layer_specs": FUSED_SPECS},
        },
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    _load_save_export(engine, FUSED, folder)


@pytest.mark.timeout(120)
def test_a_zerospeed_checkpoint_with_a_fused_qkv_weight_exports_as_the_files_deepspeed_wrote(tmp_path):
    run_distributed(_fused_resume_save_export, 2, str(tmp_path), timeout=100)
    _compare_with_deepspeeds_files(
        tmp_path / "ds" / "step3", FUSED / "step3", "zerospeed -> tp_fused", skip=("ds_config",)
    )
