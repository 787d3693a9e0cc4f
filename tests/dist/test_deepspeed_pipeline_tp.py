"""Resuming a DeepSpeed pipeline run with Megatron-style tensor parallelism inside the stages in zerospeed's
PipelineEngine (Note [DeepSpeed pipeline checkpoints with tp] in checkpoint/deepspeed_pipeline_tp.py).

The fixtures `pipe_tp_zero0` / `pipe_tp_zero1` (make_pipe_tp.py) are the tags the real DeepSpeed 0.19.8 saved after
3 of 6 `train_batch` steps of 8 layers (column- / row-parallel Linears written with plain torch.distributed, a
LayerNorm, a replicated Linear) as 2 stages x tp 2 x dp 1 on its PipeModelDataParallelTopology, ZeRO 0 / 1, with
`universal_checkpoint_info` naming the row-parallel weights and the replicated parameters. The same layer code is
built here on zerospeed's grid (its tp group); zerospeed's PipelineEngine loads the tags and trains steps 4-6:
DeepSpeed's losses (rank for rank) and its step-6 weights within 1e-6 — at the saved layout, at pp 2 x tp 1 x dp 2
(full tensors) and at pp 1 x tp 2 x dp 2 (re-cut by the patterns). Without the optimizer states the losses differ
(the test can fail); a tag without `universal_checkpoint_info` is refused naming its file.

The other way (Note [pipeline export with tp]): zerospeed's own run of the same full layers (its Column/Row-
ParallelLinear) saved at ZeRO 0, 1 and 2 exports to DeepSpeed's own step-3 tags (`--to deepspeed`) and to DeepSpeed's
own universal folder (`--to universal`), file for file; a ZeRO-1 save without the flat files' tp layouts is refused.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_same_contents, fixture_script

RUN_FILE = FIXTURES / "pipe_tp_zero0" / "deepspeed_run.pt"


def _same(mine, theirs, where: str) -> None:
    """The same structure, dtypes and shapes; tensors within 1e-6 (DeepSpeed's run and zerospeed's agree to
    rounding)."""
    assert_same_contents(mine, theirs, where, atol=1e-6)


# (fixture, pp, tp, ZeRO stage of the loading engine, with optimizer states)
CASES = [
    ("pipe_tp_zero0", 2, 2, 0, True),
    ("pipe_tp_zero1", 2, 2, 1, True),
    ("pipe_tp_zero0", 2, 1, 1, True),
    ("pipe_tp_zero1", 1, 2, 0, True),
    ("pipe_tp_zero0", 2, 2, 0, False),
    ("pipe_tp_universal", 2, 2, 1, True),
    ("pipe_tp_universal", 1, 2, 0, True),
    ("pipe_tp_universal", 2, 1, 2, True),
]
UNIVERSAL = {5: "pp2tp2-zero1", 6: "pp1tp2dp2-zero0", 7: "pp2tp1dp2-zero2"}
ZS_ZERO = (0, 1, 2)  # the ZeRO stages of zerospeed's own pp 2 x tp 2 runs saved for the export


def _resume(fixture: str, pp: int, tp: int, zero: int, with_optimizer: bool, save_to: str | None = None) -> dict:
    import zerospeed
    from zerospeed import comm
    from zerospeed.comm.mesh import ParallelMesh
    from zerospeed.parallel.pipeline.topology import PipeModelDataParallelTopology
    from zerospeed.pipe import PipelineModule

    make = fixture_script("make_pipe_tp")
    dp = comm.get_world_size() // (pp * tp)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    mesh = ParallelMesh.from_grid(topology.to_grid())
    group, tp_rank = mesh.group("tp"), mesh.rank_in("tp")
    net = PipelineModule(
        make.layers(group, tp, tp_rank), topology=topology, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    gas = 4 // dp
    cfg = fixture_script("make").config(zero, gradient_accumulation_steps=gas, gradient_clipping=0.0)  # (DeepSpeed's)
    universal = fixture == "pipe_tp_universal"  # (its tag: the one latest_universal names)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(
        str(FIXTURES / fixture),
        tag=None if universal else "step3",
        load_optimizer_states=with_optimizer,
        load_lr_scheduler_states=True,
    )
    steps, d = engine.global_steps, mesh.rank_in("dp")
    losses = []
    for x, y in make.batches(1)[3:]:  # DeepSpeed's global batches (dp 1): the same 8 rows per step at every dp
        losses.append(float(engine.train_batch(data_iter=iter(make.micro_batches(x, y, dp, d, gas)))))
    weights = {}
    for idx in net.local_layer_indices():
        module = net.layer_module(idx)
        if module is not None:
            weights[idx] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    save_error = None
    if save_to is not None:  # the plain layers' split is invisible to zerospeed: its save must refuse
        from zerospeed.checkpoint.errors import CheckpointError

        try:
            engine.save_checkpoint(save_to, tag="plain")
        except CheckpointError as e:
            save_error = str(e)
    return {
        "losses": losses,
        "steps": steps,
        "weights": weights,
        "tp_rank": tp_rank,
        "dp_rank": d,
        "save_error": save_error,
    }


def _train_and_save(path: str, zero: int) -> None:
    """make_pipe_tp.py's run in zerospeed with its own tensor-parallel layers cut from the same full layers
    (2 stages x tp 2, ZeRO `zero`): 3 steps, saved as `step3`."""
    import zerospeed
    from zerospeed.comm.mesh import ParallelMesh
    from zerospeed.parallel.pipeline.topology import PipeModelDataParallelTopology
    from zerospeed.pipe import PipelineModule

    make = fixture_script("make_pipe_tp")
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    layers = make.zerospeed_layers(ParallelMesh.from_grid(topology.to_grid()).group("tp"))
    net = PipelineModule(layers, topology=topology, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = fixture_script("make").config(zero, gradient_accumulation_steps=4, gradient_clipping=0.0)
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    for x, y in make.batches(1)[:3]:
        engine.train_batch(data_iter=iter(make.micro_batches(x, y, 1, 0)))
    engine.save_checkpoint(path, tag="step3")


def _all_cases(path: str) -> list[dict]:
    out = [_resume(*case, save_to=f"{path}/plain" if i == 0 else None) for i, case in enumerate(CASES)]
    for zero in ZS_ZERO:
        _train_and_save(f"{path}/zero{zero}", zero)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("zs_pipe_tp")


@pytest.fixture(scope="module")
def results(saved):
    return run_distributed(_all_cases, 4, str(saved), timeout=150)


def _full_weights(per_rank: list[dict], tp: int) -> dict:
    """The layers' full weights joined from the tp ranks by the fixture's own patterns (make_pipe_tp.join_full)."""
    make = fixture_script("make_pipe_tp")
    by_layer: dict[int, dict[int, dict]] = {}
    for r in per_rank:
        if r["dp_rank"] == 0:
            for idx, state in r["weights"].items():
                by_layer.setdefault(idx, {})[r["tp_rank"]] = state
    out = {}
    for idx, states in by_layer.items():
        out.update(make.join_full([states[t] for t in range(tp)], f"{idx}."))
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", range(4), ids=["pp2tp2-zero0", "pp2tp2-zero1-tag", "pp2tp1dp2", "pp1tp2dp2"])
def test_a_deepspeed_pipeline_tp_run_resumes_in_zerospeed(results, case):
    want = torch.load(RUN_FILE, weights_only=True)
    per_rank = [r[case] for r in results]
    for r in per_rank:
        assert r["steps"] == 3
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"][3:])) <= 1e-6, (r["losses"], want["losses"])
    weights = _full_weights(per_rank, CASES[case][2])
    assert set(weights) == set(want["step6_weights"])
    for k, v in want["step6_weights"].items():
        torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=k)


@pytest.mark.timeout(150)
def test_the_zero1_tag_has_the_zero0_run_s_losses():
    """Both DeepSpeed runs (ZeRO 0 and 1 at dp 1) trained the same: one recorded continuation serves both."""
    zero1 = torch.load(FIXTURES / "pipe_tp_zero1" / "deepspeed_run.pt", weights_only=True)
    want = torch.load(RUN_FILE, weights_only=True)
    assert max(abs(a - b) for a, b in zip(zero1["losses"], want["losses"])) <= 1e-6


@pytest.mark.timeout(150)
def test_without_the_optimizer_states_the_continuation_differs(results):
    want = torch.load(RUN_FILE, weights_only=True)
    got = results[0][4]["losses"]
    assert max(abs(a - b) for a, b in zip(got, want["losses"][3:])) > 1e-4


def test_a_tag_without_universal_checkpoint_info_is_refused(tmp_path):
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.deepspeed_pipeline_tp import read_deepspeed_pipeline_tp
    from zerospeed.checkpoint.errors import CheckpointError

    tag = tmp_path / "step3"
    shutil.copytree(FIXTURES / "pipe_tp_zero0" / "step3", tag)
    for path in tag.glob("mp_rank_*_model_states.pt"):
        state = _load(path)
        state.pop("universal_checkpoint_info")
        torch.save(state, tmp_path / "new.pt")  # (not over the memory-mapped file)
        (tmp_path / "new.pt").replace(path)
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt.*universal_checkpoint_info"):
        read_deepspeed_pipeline_tp(tag)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zs_zero", ZS_ZERO, ids=[f"zs-zero{z}" for z in ZS_ZERO])
@pytest.mark.parametrize("stage", [0, 1])
def test_export_of_a_zerospeed_pipeline_tp_checkpoint_matches_deepspeeds_own_tag(
    results, saved, tmp_path, stage, zs_zero
):
    """zerospeed's pp 2 x tp 2 run (its own Column/RowParallelLinear) saved after 3 steps at ZeRO 0, 1 or 2
    (per-layer files, or per-rank flat files joined over tp by the layouts their pieces record), exported for
    DeepSpeed at ZeRO 0 / 1: the same files as DeepSpeed's own step-3 tag of the same run (pipe_tp_zero0/1), the
    tensors within 1e-6 (weights, Adam states, ZeRO-1 flat partitions), the counters and layout records equal.
    (That the real DeepSpeed resumes it: benchmarks/deepspeed_pipeline_differential.py --tp 2 [--zs-zero Z].)"""
    from zerospeed.checkpoint.cli import main as ckpt
    from zerospeed.checkpoint.deepspeed_import import _load

    source = str(saved / f"zero{zs_zero}")
    assert ckpt(["export", source, str(tmp_path), "--to", "deepspeed", "--stage", str(stage), "--dp", "1"]) == 0
    mine_dir, theirs_dir = tmp_path / "step3", FIXTURES / f"pipe_tp_zero{stage}" / "step3"
    assert sorted(p.name for p in mine_dir.iterdir()) == sorted(p.name for p in theirs_dir.iterdir())
    skip = {"ds_config", "universal_checkpoint_info", "lr_scheduler"}  # (the info: named per parameter here)
    for theirs_path in sorted(theirs_dir.iterdir()):
        mine, theirs = _load(mine_dir / theirs_path.name), _load(theirs_path)
        if theirs_path.name.startswith("layer_"):
            _same(mine, theirs, theirs_path.name)
            continue
        for key in theirs:
            if key not in skip:
                _same(mine[key], theirs[key], f"{theirs_path.name}[{key!r}]")
    # the universal_checkpoint_info the export wrote joins its pieces into the full tensors DeepSpeed's own gives
    from zerospeed.checkpoint.deepspeed_pipeline_tp import read_deepspeed_pipeline_tp

    _same(
        read_deepspeed_pipeline_tp(mine_dir).universal.tensors,
        read_deepspeed_pipeline_tp(theirs_dir).universal.tensors,
        "full",
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zs_zero", ZS_ZERO, ids=[f"zs-zero{z}" for z in ZS_ZERO])
def test_universal_export_of_a_zerospeed_pipeline_tp_checkpoint_matches_deepspeeds_own_folder(
    results, saved, tmp_path, zs_zero
):
    """`export --to universal` of zerospeed's pp 2 x tp 2 save: the folder DeepSpeed's own ds_to_universal made of
    its ZeRO-1 tag of the same run (pipe_tp_universal): the same files, keys (`cat_dim` on the split parameters
    only) and values within 1e-6; its universal_checkpoint_info (named per parameter here) reads back into the same
    full tensors. (That the real DeepSpeed resumes it: the differential --tp 2 --universal.)"""
    from zerospeed.checkpoint.cli import main as ckpt
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.deepspeed_pipeline_tp import read_deepspeed_pipeline_universal_tp

    assert ckpt(["export", str(saved / f"zero{zs_zero}"), str(tmp_path), "--to", "universal", "--dp", "1"]) == 0
    assert (tmp_path / "latest_universal").read_text() == "step3_universal"
    mine, theirs = tmp_path / "step3_universal", FIXTURES / "pipe_tp_universal" / "step3_universal"
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*.pt"))
    assert files == sorted(p.relative_to(mine) for p in mine.rglob("*.pt"))
    skip = {"ds_config", "universal_checkpoint_info", "lr_scheduler"}
    for name in files:
        a, b = _load(mine / name), _load(theirs / name)
        if isinstance(b, dict):
            assert set(a) == set(b), name
            a, b = ({k: d[k] for k in b if k not in skip} for d in (a, b))
        _same(a, b, str(name))
    _same(
        read_deepspeed_pipeline_universal_tp(mine).universal.tensors,
        read_deepspeed_pipeline_universal_tp(theirs).universal.tensors,
        "full",
    )


def test_a_zero1_save_without_tp_layouts_is_refused_naming_the_file(results, saved, tmp_path):
    """A ZeRO-1 pp x tp save from before the flat files recorded their tp layouts: the export names the file and
    the fix instead of guessing the split."""
    from zerospeed.checkpoint.deepspeed_pipeline_tp import export_pipeline_tp_to_deepspeed
    from zerospeed.checkpoint.errors import CheckpointError

    old = tmp_path / "old"
    shutil.copytree(saved / "zero1", old)
    path = old / "step3" / "zero_pp_rank_1_dp_rank_0_mp_rank_01_optim_states.pt"
    flat = torch.load(path, weights_only=False)
    flat["pieces"] = [[{k: v for k, v in p.items() if k != "tp_layout"} for p in ps] for ps in flat["pieces"]]
    torch.save(flat, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_01_optim_states.pt: records no tp layout.*save it again"):
        export_pipeline_tp_to_deepspeed(old, tmp_path / "out", stage=1, dp=1)


def test_export_refuses_a_split_megatrons_categories_cannot_name(tmp_path):
    """An uneven split (7 rows over 2 ranks) has no DeepSpeed category: refused naming the parameter."""
    from zerospeed.checkpoint.deepspeed_pipeline_tp import _categories
    from zerospeed.checkpoint.errors import CheckpointError
    from zerospeed.checkpoint.slices import ShardSpec
    from zerospeed.checkpoint.tensor_parallel import TPLayout

    even = TPLayout((ShardSpec(1, 8, ((0, 4),)), ShardSpec(1, 8, ((4, 4),))))
    assert _categories({"2.weight": even}, ["2.weight", "2.bias"], tmp_path) == {
        "parameter_with_row_parallelism_patterns": [r"^2\.weight$"],
        "tp_replicated_parameter_patterns": [r"^2\.bias$"],
    }
    uneven = TPLayout((ShardSpec(0, 7, ((0, 4),)), ShardSpec(0, 7, ((4, 3),))))
    with pytest.raises(CheckpointError, match=r"0\.weight is split unevenly"):
        _categories({"0.weight": uneven}, ["0.weight"], tmp_path)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(UNIVERSAL), ids=list(UNIVERSAL.values()))
def test_deepspeeds_universal_folder_of_a_pipeline_tp_tag_resumes_in_zerospeed(results, case):
    """DeepSpeed's own ds_to_universal of `pipe_tp_zero1` (pipe_tp_universal), loaded with checkpoint.load_universal:
    the losses and step-6 weights of DeepSpeed's own run from that folder within 1e-6, at pp x tp x dp x ZeRO =
    2 x 2 x 1 x 1, 1 x 2 x 2 x 0 and 2 x 1 x 2 x 2."""
    want = torch.load(FIXTURES / "pipe_tp_universal" / "deepspeed_run.pt", weights_only=True)
    per_rank = [r[case] for r in results]
    for r in per_rank:
        assert r["steps"] == 3
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"])) <= 1e-6, (r["losses"], want["losses"])
    weights = _full_weights(per_rank, CASES[case][2])
    assert set(weights) == set(want["step6_weights"])
    for k, v in want["step6_weights"].items():
        torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=k)


def test_zerospeed_refuses_to_save_hand_split_layers_it_cannot_see(results, saved):
    """zerospeed cannot see how the fixture's plain Megatron-style layers split their weights: saving them would
    write tp rank 0's pieces as whole tensors, so the save is refused, naming a split parameter, before any file."""
    errors = [per_rank[0]["save_error"] for per_rank in results]  # (case 0: pp 2 x tp 2, plain layers)
    assert all(e is not None and "has no tensor-parallel layout but differs between tp rank 0" in e for e in errors)
    assert not (saved / "plain" / "plain").exists()
