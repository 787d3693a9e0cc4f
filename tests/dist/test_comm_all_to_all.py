"""The gateway's all-to-all (even and uneven) and its differentiable forms, against the permutation
computed in one process from every rank's full input; the counted bytes against the formula."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zerospeed import comm
from zerospeed.comm.functional import all_to_all, seq_all_to_all

WORLD = 4


def _input(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _weight(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _splits(rank: int) -> list[int]:
    """Rows rank `rank` sends to each rank (uneven, some zero)."""
    return [(rank + 2 * j) % 3 for j in range(WORLD)]


def _run():
    rank = comm.get_rank()
    out = {}
    # uneven rows with autograd
    ins = _splits(rank)
    outs = [_splits(j)[rank] for j in range(WORLD)]
    x = _input(rank, (sum(ins), 3)).requires_grad_()
    y = all_to_all(x, None, outs, ins)
    (y * _weight(rank, y.shape)).sum().backward()
    out["uneven"] = (y.detach(), x.grad)
    # the sequence form: [s/P, h, d] -> [s, h/P, d]
    comm.STATS.reset()
    x = _input(rank, (2, 8, 3)).requires_grad_()
    y = seq_all_to_all(x, None, scatter_dim=1, gather_dim=0)
    (y * _weight(rank, y.shape)).sum().backward()
    out["seq"] = (y.detach(), x.grad, comm.STATS.snapshot()["all_to_all"])
    back = seq_all_to_all(y.detach(), None, scatter_dim=0, gather_dim=1)
    out["roundtrip"] = torch.equal(back, x.detach())
    return out


@pytest.mark.timeout(120)
def test_all_to_all_matches_the_permutation_and_its_gradient():
    results = run_distributed(_run, WORLD)
    # uneven: rank r receives, from each j in order, the rows j sends to r
    xs = [_input(r, (sum(_splits(r)), 3)) for r in range(WORLD)]
    pieces = [list(x.split(_splits(r))) for r, x in enumerate(xs)]
    for r, res in enumerate(results):
        y, _ = res["uneven"]
        assert torch.equal(y, torch.cat([pieces[j][r] for j in range(WORLD)]))
    # gradient: d/dx_j of sum_r <w_r, y_r>: the slices of w_r that came from j, back in j's order
    ws = [_weight(r, results[r]["uneven"][0].shape) for r in range(WORLD)]
    for j, res in enumerate(results):
        recv_sizes = [[_splits(i)[r] for i in range(WORLD)] for r in range(WORLD)]
        expect = torch.cat([ws[r].split(recv_sizes[r])[j] for r in range(WORLD)])
        assert torch.equal(res["uneven"][1], expect)
    # sequence form: the full [s, h, d] tensor, then rank r keeps heads r*h/P..(r+1)*h/P
    full = torch.cat([_input(r, (2, 8, 3)) for r in range(WORLD)], dim=0)
    seq_ws = [_weight(r, (8, 2, 3)) for r in range(WORLD)]
    full_w = torch.cat(seq_ws, dim=1)  # [s, h, d]: the weight each head slice is multiplied by
    for r, res in enumerate(results):
        y, grad, stats = res["seq"]
        assert torch.equal(y, full[:, 2 * r : 2 * r + 2])
        assert torch.equal(grad, full_w[2 * r : 2 * r + 2])
        # forward + backward: two all-to-alls of this rank's 2*8*3 doubles; 3/4 of each leaves the rank
        assert stats["calls"] == 2 and stats["payload_bytes"] == 2 * 2 * 8 * 3 * 8
        assert stats["wire_bytes"] == pytest.approx(stats["payload_bytes"] * 3 / 4)
        assert res["roundtrip"]
