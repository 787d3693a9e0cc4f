"""bf16 AutoEP checkpoints export to DeepSpeed 0.19.8's bf16 AutoEP layout at ZeRO 1, 2, 3 (Note [DeepSpeed AutoEP
export] in checkpoint/deepspeed_autoep_export.py: `bf16_zero_pp_rank_*` optimizer files holding the fp32 masters and
Adam moments, bf16 weights in the model states and expert files).

The independent reference is what the real DeepSpeed wrote: fixtures autoep_zero{1,2,3}_ep2_bf16 (make_autoep.py
--bf16) hold the tag DeepSpeed's AutoEP saved after 3 bf16 steps of a tiny Mixtral on 2 gloo ranks, ep 2.
- Rewrite: DeepSpeed's tag, read (deepspeed_autoep*.py) and written back at the same or the other stage, equals
  DeepSpeed's own tag file for file: the same keys in the same order, shapes, dtypes, metadata, and values bit for
  bit (fp32 masters, moments, the bf16 weights). DeepSpeed's ZeRO-2 and ZeRO-3 bf16 runs are the same run (their
  losses and masters are equal), so ZeRO 2 <-> 3 is compared whole. Its ZeRO-1 bf16 run is another one (the dense
  masters differ by 3.2e-5 from the ZeRO-2 run's: bf16 gradients reduced otherwise), so ZeRO 1 <-> 2 is compared
  with the other stage's tag for keys, order, shapes, dtypes and metadata, and with the read tag for values (ZeRO 1
  and 2 write the same partitions; only `zero_stage`, and `frozen_param_shapes` / `_fragments` recorded from ZeRO 2
  on, differ).
- zerospeed's own bf16 checkpoint: zerospeed's AutoEP in bf16 at ZeRO 3, ep 1 loads DeepSpeed's ZeRO-2 bf16 tag and
  saves it in its own layout; that checkpoint exported at ZeRO 2 and 3, ep 2 equals DeepSpeed's tags bit for bit.
That the real DeepSpeed resumes such exports: benchmarks/deepspeed_autoep_differential.py --bf16.
The test can fail: with the optimizer files named without `bf16_` it stops at the file list; with the weights
written in fp32 at layer_0_expert_0's `w1.0` (dtype); with ZeRO 1/2's fp32 masters rounded through bf16 at
`single_partition_of_fp32_groups` (off by 1.2e-4).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_like_deepspeeds_tag, assert_same_contents, fixture_script

pytest.importorskip("transformers")
make_autoep = fixture_script("make_autoep")  # DeepSpeed's model and config

ANY_VALUE = float("inf")  # assert_same_contents' tolerance when only keys, shapes, dtypes and metadata must agree


def _source(fixture: str):
    from zerospeed.checkpoint.deepspeed_autoep import (
        is_deepspeed_autoep_zero3_tag,
        read_deepspeed_autoep_zero3_checkpoint,
    )
    from zerospeed.checkpoint.deepspeed_autoep_zero12 import read_deepspeed_autoep_zero12_checkpoint
    from zerospeed.checkpoint.deepspeed_export import source_from_deepspeed

    tag_dir = FIXTURES / fixture / "step3"
    zero3 = is_deepspeed_autoep_zero3_tag(tag_dir)
    return source_from_deepspeed(
        (read_deepspeed_autoep_zero3_checkpoint if zero3 else read_deepspeed_autoep_zero12_checkpoint)(tag_dir)
    )


def _files(tag_dir, fixture: str, stage: int, atol: float = 0.0, values_of: str | None = None) -> None:
    """Every file of DeepSpeed's `fixture` tag is in `tag_dir` and equals it (within `atol`); with `values_of`, the
    values are compared with that fixture's files instead (ZeRO 1 <-> 2: the same partitions)."""
    from zerospeed.checkpoint.deepspeed_import import _load

    def check_config(cfg: dict, want: dict) -> None:
        assert cfg["zero_optimization"]["stage"] == want["zero_optimization"]["stage"] == stage
        assert cfg["bf16"]["enabled"] and want["bf16"]["enabled"]
        assert cfg["expert_parallel"]["autoep_size"] == want["expert_parallel"]["autoep_size"] == 2

    assert_like_deepspeeds_tag(tag_dir, fixture, check_config, atol)
    for path in sorted((FIXTURES / values_of / "step3").iterdir()) if values_of else []:
        mine, same = _load(tag_dir / path.name), _load(path)
        for d in (mine, same):  # (the stage's own records, compared with `fixture`'s above)
            d.pop("ds_config", None), d.pop("frozen_param_shapes", None), d.pop("frozen_param_fragments", None)
            (d.get("optimizer_state_dict") or {}).pop("zero_stage", None)
        assert_same_contents(mine, same, f"{path.name} (values)")


REWRITES = [  # (DeepSpeed's bf16 tag read, ZeRO stage written, DeepSpeed's tag it must look like, values of)
    ("autoep_zero2_ep2_bf16", 2, "autoep_zero2_ep2_bf16", None),
    ("autoep_zero2_ep2_bf16", 3, "autoep_zero3_ep2_bf16", None),
    ("autoep_zero3_ep2_bf16", 2, "autoep_zero2_ep2_bf16", None),
    ("autoep_zero1_ep2_bf16", 1, "autoep_zero1_ep2_bf16", None),
    ("autoep_zero1_ep2_bf16", 2, "autoep_zero2_ep2_bf16", "autoep_zero1_ep2_bf16"),
    ("autoep_zero2_ep2_bf16", 1, "autoep_zero1_ep2_bf16", "autoep_zero2_ep2_bf16"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read,stage,want,values", REWRITES, ids=[f"{r[0]}-at-zero{r[1]}" for r in REWRITES])
def test_deepspeed_bf16_autoep_tag_rewrites_to_deepspeeds(read, stage, want, values, tmp_path):
    from zerospeed.checkpoint.deepspeed_autoep_export import write_deepspeed_autoep_tag

    tag = write_deepspeed_autoep_tag(_source(read), tmp_path, "step3", stage=stage, dp=2, ep=2)
    _files(tag, want, stage, ANY_VALUE if values else 0.0, values)


def _load_and_save(folder: str) -> None:
    """zerospeed's AutoEP in bf16 at ZeRO 3, ep 1 loads DeepSpeed's ZeRO-2 bf16 tag and saves it as `step3`."""
    import zerospeed

    m = make_autoep.mixtral()
    cfg = make_autoep.config(3, expert_parallel={"enabled": True, "autoep_size": 1, "preset_model": "mixtral"})
    cfg["bf16"] = {"enabled": True}
    eng, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    eng.load_checkpoint(str(FIXTURES / "autoep_zero2_ep2_bf16"), tag="step3")
    eng.save_checkpoint(folder, tag="step3")


@pytest.mark.timeout(240)
def test_zerospeed_bf16_autoep_checkpoint_exports_as_deepspeeds(tmp_path):
    from zerospeed.checkpoint.cli import main
    from zerospeed.checkpoint.deepspeed_autoep_export import export_autoep_to_deepspeed
    from zerospeed.checkpoint.manifest import read_manifest

    folder = tmp_path / "zs"
    run_distributed(_load_and_save, 2, str(folder), timeout=200)
    assert read_manifest(folder / "step3")["param_dtype"] == "bfloat16"
    tag = export_autoep_to_deepspeed(folder, tmp_path / "z2", stage=2, dp=2, ep=2)
    _files(tag, "autoep_zero2_ep2_bf16", 2)
    argv = ["export", str(folder), str(tmp_path / "z3"), "--to", "deepspeed", "--stage", "3", "--dp", "2"]
    assert main([*argv, "--ep", "2"]) == 0
    _files(tmp_path / "z3" / "step3", "autoep_zero3_ep2_bf16", 3)


@pytest.mark.timeout(60)
def test_bf16_autoep_export_refusals_name_the_fix(tmp_path):
    """ZeRO 0 (DeepSpeed's BF16_Optimizer wrapper), ZeRO 1 with fp32 gradient accumulation (its BF16_Optimizer) and
    fp16 (DeepSpeed builds no fp16 run on CPU: "Type fp16 is not supported on your device") are refused."""
    import dataclasses

    from zerospeed.checkpoint.deepspeed_autoep_export import write_deepspeed_autoep_tag
    from zerospeed.checkpoint.errors import CheckpointError

    src = _source("autoep_zero2_ep2_bf16")
    with pytest.raises(CheckpointError, match="export at stage 1, 2 or 3"):
        write_deepspeed_autoep_tag(src, tmp_path, "t", stage=0, dp=2, ep=2)
    fp32_accum = dataclasses.replace(
        src, meta={**src.meta, "ds_config": {**src.meta["ds_config"], "data_types": {"grad_accum_dtype": "fp32"}}}
    )
    with pytest.raises(CheckpointError, match="grad_accum_dtype"):
        write_deepspeed_autoep_tag(fp32_accum, tmp_path, "t", stage=1, dp=2, ep=2)
    write_deepspeed_autoep_tag(fp32_accum, tmp_path, "t", stage=2, dp=2, ep=2)  # (ZeRO 2: DeepSpeed's ZeRO optimizer)
    with pytest.raises(CheckpointError, match="only fp32 and bf16"):
        write_deepspeed_autoep_tag(
            dataclasses.replace(src, param_dtype=torch.float16), tmp_path, "t", stage=2, dp=2, ep=2
        )
