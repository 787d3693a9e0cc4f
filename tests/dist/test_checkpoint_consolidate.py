"""Consolidation of 2-rank checkpoints (stages 0, 1, 2; fp32 and bf16) into one fp32 state dict, its
safetensors / torch exports, the zerospeed-ckpt CLI, and the collective checks of a 2-rank load:
tag validation and a corrupted shard named on every rank.

One 2-rank job writes all checkpoints (module-scoped fixture); the rest runs here without processes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import GAS, build_model, make_engine, zero_config
from test_zero_parity import global_batches

from harness import run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.checkpoint import (
    CheckpointError,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zerospeed.checkpoint.cli import main as cli_main
from zerospeed.checkpoint.export import read_exported
from zerospeed.zero.shards import parameter_names

CASES = {
    "s0": zero_config(0),
    "s1": zero_config(1),
    "s2": zero_config(2),
    "s2bf16": zero_config(2, bf16={"enabled": True}),
    "s3": zero_config(3),
}


def _train(engine, steps: int) -> None:
    world, rank = comm.get_world_size(), comm.get_rank()
    for batch in global_batches(world, steps):
        for x, y in split_global_batch(batch, world, GAS, rank):
            engine.backward(engine(x, y))
            engine.step()


def _tag_validation(root: Path) -> dict:
    """Ranks passing different tags: FAIL raises everywhere, WARN saves under rank 0's tag."""
    out = {}
    for mode in ("FAIL", "WARN"):
        engine, _ = make_engine({**zero_config(1), "checkpoint": {"tag_validation": mode}})
        try:
            engine.save_checkpoint(str(root / f"tags_{mode}"), tag=f"rank{comm.get_rank()}")
            out[mode] = sorted(p.name for p in (root / f"tags_{mode}").iterdir())
        except CheckpointError as exc:
            out[mode] = str(exc)
    return out


def _corrupt_shard_then_load(root: Path) -> str:
    engine, _ = make_engine(zero_config(2))
    engine.save_checkpoint(str(root / "corrupt"), tag="t")
    comm.barrier()
    if comm.get_rank() == 0:
        shard = root / "corrupt" / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    comm.barrier()
    try:
        engine.load_checkpoint(str(root / "corrupt"))
    except CheckpointError as exc:
        return str(exc)
    return "loaded without error"


from test_checkpoint_resume import module_state  # noqa: E402  (tests/dist is on sys.path)


def _save_all(root: str) -> dict:
    root = Path(root)
    out = {}
    for name, config in CASES.items():
        engine, _ = make_engine(config)
        _train(engine, 1)
        engine.save_checkpoint(str(root / name))
        entries = engine.zero.shard_entries(parameter_names(engine.module))
        out[name] = {
            "module": module_state(engine),
            "entries": [(e.pieces, e.master.detach().clone()) for e in entries],
        }
    out["tags"] = _tag_validation(root)
    out["corrupt"] = _corrupt_shard_then_load(root)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("consolidate")
    results = run_distributed(_save_all, 2, str(root), timeout=110)
    return root, results


def masters_from_entries(results: list[dict], case: str) -> dict[str, torch.Tensor]:
    """The engines' fp32 masters per parameter, assembled here from each rank's pieces."""
    shapes = {n: p.shape for n, p in build_model().named_parameters()}
    flat = {n: torch.full((s.numel(),), float("nan")) for n, s in shapes.items()}
    for r in results:
        for pieces, master in r[case]["entries"]:
            for p in pieces:
                flat[p.name][p.param_offset : p.param_offset + p.numel] = master.reshape(-1)[
                    p.offset : p.offset + p.numel
                ]
    return {n: t.view(shapes[n]) for n, t in flat.items() if not torch.isnan(t).all()}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["s0", "s1", "s2", "s2bf16", "s3"])
def test_consolidated_state_dict_loads_strictly_and_equals_the_fp32_masters(saved, case):
    root, results = saved
    sd = get_fp32_state_dict_from_zero_checkpoint(root / case)
    model = build_model(seed=5)
    model.load_state_dict(sd, strict=True)
    masters = masters_from_entries(results, case)
    assert set(masters) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, master in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], master), name
    module = results[0][case]["module"]
    assert torch.equal(sd["wpe.weight"], module["wpe.weight"])  # frozen
    assert torch.equal(sd["position_scale"], module["position_scale"])  # buffers
    assert sd["seen_batches"].item() == module["seen_batches"].item() == GAS
    assert sd["lm_head.weight"] is sd["wte.weight"]  # tied: one tensor
    assert list(sd) == list(model.state_dict())
    if case == "s2bf16":  # the masters are more precise than the bf16 weights the model trained with
        assert module["wte.weight"].dtype == torch.bfloat16
        assert not torch.equal(sd["wte.weight"], module["wte.weight"].float())
        torch.testing.assert_close(sd["wte.weight"].bfloat16(), module["wte.weight"], rtol=0, atol=0)
    else:
        for k, v in module.items():
            assert torch.equal(sd[k], v), k


def test_frozen_parameters_can_be_excluded(saved):
    root, _ = saved
    sd = get_fp32_state_dict_from_zero_checkpoint(root / "s1", exclude_frozen_parameters=True)
    assert "wpe.weight" not in sd and "wte.weight" in sd and "position_scale" in sd
    result = build_model().load_state_dict(sd, strict=False)
    assert result.missing_keys == ["wpe.weight"] and result.unexpected_keys == []


def test_load_state_dict_from_zero_checkpoint_fills_a_plain_model(saved):
    root, results = saved
    model = load_state_dict_from_zero_checkpoint(build_model(seed=3), root / "s2")
    for name, master in masters_from_entries(results, "s2").items():
        assert torch.equal(model.get_parameter(name), master), name
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("safe", [True, False])
def test_export_round_trips_as_one_file_or_as_shards_with_an_index(saved, tmp_path, safe):
    root, _ = saved
    sd = get_fp32_state_dict_from_zero_checkpoint(root / "s1")
    ext = "safetensors" if safe else "bin"
    stem = "model" if safe else "pytorch_model"
    one = convert_zero_checkpoint_to_fp32_state_dict(root / "s1", tmp_path / "one", safe_serialization=safe)
    assert one == [tmp_path / "one" / f"{stem}.{ext}"]
    many = convert_zero_checkpoint_to_fp32_state_dict(
        root / "s1", tmp_path / "many", max_shard_size="40KB", safe_serialization=safe
    )
    index = json.loads((tmp_path / "many" / f"{stem}.{ext}.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "many").glob(f"{stem}-*.{ext}"))
    assert len(shards) >= 3 and many[-1].name == f"{stem}.{ext}.index.json"
    assert shards[0] == f"{stem}-00001-of-{len(shards):05d}.{ext}"
    assert set(index["weight_map"].values()) == set(shards)
    unique = {k for k in sd if k != "lm_head.weight"}
    assert set(index["weight_map"]) == (unique if safe else set(sd))
    assert index["metadata"]["total_size"] == sum(sd[k].nbytes for k in unique)
    assert index["metadata"]["tied"] == {"lm_head.weight": "wte.weight"}
    for out in ("one", "many"):
        back = read_exported(tmp_path / out)
        assert back.keys() == sd.keys()
        for k, v in sd.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), (out, k)
        assert back["lm_head.weight"] is back["wte.weight"] or torch.equal(back["lm_head.weight"], back["wte.weight"])
        build_model().load_state_dict(back, strict=True)


def test_safetensors_output_is_readable_by_the_safetensors_package(saved, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    root, _ = saved
    convert_zero_checkpoint_to_fp32_state_dict(root / "s2", tmp_path, safe_serialization=True)
    theirs = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    ours = get_fp32_state_dict_from_zero_checkpoint(root / "s2")
    assert set(theirs) == set(ours) - {"lm_head.weight"}
    for k, v in theirs.items():
        assert torch.equal(v, ours[k]), k


def test_tag_validation_fail_raises_on_every_rank_and_warn_uses_rank_0s_tag(saved):
    _, results = saved
    for r in results:
        assert r["tags"]["FAIL"].startswith(
            "checkpoint tags differ across ranks: 'rank0' on ranks [0]; 'rank1' on ranks [1]"
        )
        assert "tag_validation is FAIL" in r["tags"]["FAIL"]
        assert r["tags"]["WARN"] == ["latest", "rank0"]


def test_a_corrupted_shard_is_named_on_every_rank(saved):
    _, results = saved
    for r in results:
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is corrupted" in r["corrupt"], r["corrupt"]


def test_consolidation_names_a_corrupted_truncated_or_missing_file(saved, tmp_path):
    root, _ = saved
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    cases = {"flip": "is corrupted: sha256", "truncate": "is truncated:", "delete": "is missing"}
    for how, message in cases.items():
        ckpt = tmp_path / how
        shutil.copytree(root / "s2", ckpt)
        path = ckpt / "global_step1" / shard
        data = path.read_bytes()
        if how == "flip":
            path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        elif how == "truncate":
            path.write_bytes(data[:-7])
        else:
            path.unlink()
        with pytest.raises(CheckpointError, match=f"{shard} {message}"):
            get_fp32_state_dict_from_zero_checkpoint(ckpt)


def test_cli_inspect_prints_the_manifest_and_verifies(saved, capsys):
    root, _ = saved
    assert cli_main(["inspect", str(root / "s2"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "tag               global_step1" in out
    assert "ZeRO stage 2, data parallel 2, world 2" in out
    assert "AdamW (2 groups)" in out and "lm_head.weight -> wte.weight" in out
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in out and "verified 3 files" in out
    assert cli_main(["inspect", str(root / "s2"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["zero_stage"] == 2 and len(manifest["partition"]) == 2
    assert cli_main(["inspect", str(root / "s2" / "global_step1")]) == 0  # a tag directory itself
    assert f"checkpoint        {root / 's2' / 'global_step1'}" in capsys.readouterr().out


def test_cli_to_fp32_writes_shards_and_reports_errors(saved, tmp_path, capsys):
    root, _ = saved
    assert cli_main(["to-fp32", str(root / "s1"), str(tmp_path / "out"), "--max-shard-size", "40KB"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("pytorch_model.bin.index.json") and len(printed) >= 4  # DeepSpeed's default
    back = read_exported(tmp_path / "out")
    assert torch.equal(back["wte.weight"], get_fp32_state_dict_from_zero_checkpoint(root / "s1")["wte.weight"])
    # DeepSpeed's zero_to_fp32.py spellings
    assert (
        cli_main(
            [
                "to-fp32",
                str(root / "s1"),
                str(tmp_path / "safe"),
                "--max_shard_size",
                "40KB",
                "--safe_serialization",
                "-t",
                "global_step1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split()[-1].endswith("model.safetensors.index.json")
    assert cli_main(["to-fp32", str(tmp_path / "nothing"), str(tmp_path / "o2")]) == 1
    assert "nothing/latest does not exist" in capsys.readouterr().err


def test_the_zerospeed_ckpt_command_is_installed(saved):
    root, _ = saved
    exe = Path(sys.executable).with_name("zerospeed-ckpt")
    done = subprocess.run([str(exe), "inspect", str(root / "s0")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ZeRO stage 0, data parallel 2" in done.stdout
