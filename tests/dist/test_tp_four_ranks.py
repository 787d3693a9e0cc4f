"""The tp=4 parity cases of test_tp_megatron_gpt.py and test_tp_autotp.py, in one 4-process spawn.

On two cores, four processes importing torch, transformers and torch.optim cost more than the
training itself, so both files' tp=4 cases share this one job; the checks are the files' own.
"""

from __future__ import annotations

import pytest
import test_tp_autotp as autotp
import test_tp_megatron_gpt as gpt

from harness import run_distributed


def _four_rank_cases():
    return {"gpt": gpt._all_cases(gpt.CASES[4]), "autotp": autotp._all_cases(autotp.CASES[4])}


@pytest.fixture(scope="module")
def runs():
    results = run_distributed(_four_rank_cases, 4, timeout=150)
    return {kind: [res[kind] for res in results] for kind in ("gpt", "autotp")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", gpt.CASES[4])
def test_megatron_gpt_tp4(runs, case):
    gpt.check_parity(runs["gpt"], 4, case)
    gpt.check_comm_bytes(runs["gpt"], 4, case)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("arch,kv,specs", autotp.CASES[4])
def test_autotp_tp4_partition_config_and_shared_kv_heads(runs, arch, kv, specs):
    autotp.check_parity(runs["autotp"], 4, arch, kv)
    autotp.check_comm_bytes(runs["autotp"], 4, arch, kv)
    autotp.check_parameter_share(runs["autotp"], 4, arch, kv)
    report = runs["autotp"][0][(arch, kv)]["report"]
    assert report.attention["model.layers.0.self_attn"] == {"num_key_value_groups": 1}  # 1 q head, 1 kv head
    assert report.layers["model.layers.1.mlp.down_proj"] == "row"
