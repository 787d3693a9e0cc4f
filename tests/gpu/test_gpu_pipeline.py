"""Pipeline parallelism over NCCL point-to-point (one GPU per stage) against one plain PyTorch process.

The stage transport posts each batch as one NCCL group once layouts are known (the first batch
negotiates them: Note [negotiation inside a batch] in zerospeed/parallel/pipeline/transport.py);
1F1B, interleaved 1F1B and fill-drain must all finish and match the reference within 1e-5 (fp32).
"""

import gpu_cases as gc
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _check(out, cases):
    refs = out[0]["references"]
    for i, (pp, gas, *_) in enumerate(cases):
        ref = refs[(len(out) // pp, gas)]
        assert ref["losses"][-1] < ref["losses"][0] - 0.1
        for rank, per_rank in enumerate(out):
            r = per_rank["results"][i]
            diffs = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
            assert max(diffs) <= 1e-5, (cases[i], rank, diffs)
            assert abs(r["eval"] - ref["eval"]) <= 1e-5, (cases[i], rank)
            if r["tied"] is not None:  # embedding (first stage) and head (last stage) stay one weight
                torch.testing.assert_close(r["tied"], ref["wte"], atol=1e-5, rtol=0)


@pytest.mark.skipif(gc.gpus() < 2, reason="needs 2 GPUs (one per pipeline stage)")
@pytest.mark.timeout(120)
def test_transport_moves_tuples_of_mixed_dtypes_over_nccl():
    import test_pipe_transport_dist as tpd  # tests/dist: the same exchange as on gloo

    tpd.check(run_distributed(tpd.exchange, 2, timeout=100, backend="nccl"))


@pytest.mark.skipif(gc.gpus() < 2, reason="needs 2 GPUs (one per pipeline stage)")
@pytest.mark.timeout(200)
def test_two_stage_pipelines_on_nccl_match_single_process():
    # (stages, micro-batches, chunks, zero stage, schedule): 1F1B, a longer steady state, interleaved,
    # GPipe fill-drain
    cases = [(2, 4, 1, 0, "1f1b"), (2, 8, 1, 0, "1f1b"), (2, 4, 2, 0, "1f1b"), (2, 4, 1, 0, "fill_drain")]
    _check(run_distributed(gc.pipe_ranks, 2, cases, timeout=170, backend="nccl"), cases)


@pytest.mark.skipif(gc.gpus() < 4, reason="needs 4 GPUs (one per rank)")
@pytest.mark.timeout(200)
def test_four_stages_and_two_by_two_on_nccl_match_single_process():
    cases = [(4, 4, 1, 0), (4, 8, 1, 0), (2, 4, 1, 1), (4, 4, 2, 0)]
    _check(run_distributed(gc.pipe_ranks, 4, cases, timeout=170, backend="nccl"), cases)
