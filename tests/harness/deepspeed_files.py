"""Comparing checkpoint files DeepSpeed wrote with files written for DeepSpeed (tests only)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_import import _Record


def assert_same_contents(mine, theirs, where: str, atol: float = 0.0) -> None:
    """`mine` equals `theirs` (as read by `deepspeed_import._load`): the same keys in the same order, tensors
    of the same dtype and shape and equal values (within `atol` when given), DeepSpeed's pickled objects of the
    same class arguments and state."""
    if isinstance(theirs, _Record):
        assert isinstance(mine, _Record), where
        assert mine.args == theirs.args, where
        skip = ("args", "kwargs")
        assert {k: v for k, v in vars(mine).items() if k not in skip} == {
            k: v for k, v in vars(theirs).items() if k not in skip
        }, where
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype, where
        assert mine.shape == theirs.shape, f"{where}: {tuple(mine.shape)} != {tuple(theirs.shape)}"
        if atol and mine.is_floating_point() and mine.numel():
            assert (mine - theirs).abs().max() <= atol, f"{where}: values differ by {(mine - theirs).abs().max()}"
        else:
            assert torch.equal(mine, theirs), f"{where}: values differ by {(mine - theirs).abs().max()}"
    elif isinstance(theirs, dict):
        assert isinstance(mine, dict), where
        assert list(mine) == list(theirs), f"{where}: keys {list(mine)} != {list(theirs)}"
        for k in theirs:
            assert_same_contents(mine[k], theirs[k], f"{where}[{k!r}]", atol)
    elif isinstance(theirs, (list, tuple)):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert_same_contents(a, b, f"{where}[{i}]", atol)
    else:
        assert mine == theirs, f"{where}: {mine!r} != {theirs!r}"


# -- the small model of tests/fixtures/deepspeed_0.19.8/make*.py and its continuation ---------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_0.19.8"


def fixture_script(name: str):
    """The fixture generator `FIXTURES/{name}.py` as a module: its model, data and config are the ones the tests
    rebuild in zerospeed (the scripts import DeepSpeed only inside their functions that run it). The folder goes
    on sys.path, so the module imports again by name in the harness's worker processes."""
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    return importlib.import_module(name)


def assert_like_deepspeeds_tag(tag_dir, fixture: str, check_config, atol: float = 0.0) -> None:
    """Every file of DeepSpeed's tag FIXTURES/fixture/step3 (and no other) is in `tag_dir` and equals it
    (`assert_same_contents`, within `atol`), `ds_config` apart: the saving library's own record of its config,
    handed to `check_config(mine, theirs)` instead."""
    from zerospeed.checkpoint.deepspeed_import import _load

    theirs = FIXTURES / fixture / "step3"
    assert sorted(p.name for p in Path(tag_dir).iterdir()) == sorted(p.name for p in theirs.iterdir())
    for path in sorted(theirs.iterdir()):
        mine, want = _load(Path(tag_dir) / path.name), _load(path)
        if "ds_config" in want:
            check_config(mine.pop("ds_config"), want.pop("ds_config"))
        assert_same_contents(mine, want, path.name, atol)


def fixture_model(scale: float = 1.0) -> torch.nn.Module:
    """make.py's model, seeded as it seeds it; its `scale` buffer was 2.0 in DeepSpeed's runs, so a load that
    brings buffers must change the 1.0 given here."""
    m = fixture_script("make").model()
    m.scale.fill_(scale)
    return m


def fixture_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The six global batches of make.py (8 samples each)."""
    return fixture_script("make").batches()


def continue_fixture_run(
    engine, m: torch.nn.Module, gas: int, dtype: torch.dtype | None = None, steps: slice = slice(3, None)
) -> list[float]:
    """Steps 4-6 (or `steps`) of make.py's run on this rank's slices (micro batch 2); the per-step losses averaged
    over the ranks, as DeepSpeed's recorded continuation has them. `dtype`: the inputs' dtype (bf16 runs)."""
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    losses = []
    for x, y in fixture_batches()[steps]:
        total = 0.0
        for micro in range(gas):
            lo = (micro * world + rank) * 2
            inputs = x[lo : lo + 2] if dtype is None else x[lo : lo + 2].to(dtype)
            loss = ((engine(inputs).float() * m.scale.float() - y[lo : lo + 2]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / gas])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    return losses


def continue_tied_pipeline(engine, net, global_batches, gas: int, micro: int = 2) -> tuple[list[float], dict]:
    """Steps 4-6 of make_pipe_tied.py's run through a zerospeed PipelineEngine: this data-parallel rank's rows of
    each global batch, `gas` micro-batches of `micro`; the losses `train_batch` returns, and the weights of the
    layers this rank holds, named as deepspeed_run.pt names them ("t." for the tied layer, else "{index}.")."""
    from zerospeed import comm

    dp, d = comm.get_world_size(engine.dp_group), comm.get_rank(engine.dp_group)
    losses = []
    for x, y in global_batches[3:]:
        rows = [(i * dp + d) * micro for i in range(gas)]
        losses.append(float(engine.train_batch(data_iter=iter([(x[r : r + micro], y[r : r + micro]) for r in rows]))))
    weights = {}
    for idx in net.local_layer_indices():
        module = net.layer_module(idx)
        if module is not None:
            prefix = "t." if idx in (0, 5) else f"{idx}."
            weights.update({prefix + k: v.detach().clone() for k, v in module.state_dict().items()})
    return losses, weights


def assert_pipeline_continuation(results: list[dict], run_file, first: int = 3) -> None:
    """Every rank resumed after 3 steps and gave the losses DeepSpeed recorded in `run_file` (its deepspeed_run.pt,
    from step `first` on) within 1e-6, and together the ranks' layer weights equal its `step6_weights` within 1e-6."""
    want = torch.load(run_file, weights_only=True)
    weights = {}
    for r in results:
        assert r["steps"] == 3
        expected = want["losses"][first:]
        assert max(abs(a - b) for a, b in zip(r["losses"], expected)) <= 1e-6, (r["losses"], expected)
        weights.update(r["weights"])
    assert set(weights) == set(want["step6_weights"])
    for k, v in want["step6_weights"].items():
        torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=k)
