"""The stage transport between two real ranks: tuples of mixed dtypes (one packed transfer each), the
first batch negotiating layouts and the second reusing them, in the 1F1B pattern of a 1-micro-batch
step (stage 0: [send activation, receive gradient]; stage 1: [receive activation] ... [send gradient])."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.parallel.pipeline.transport import RecvOp, SendOp, Transport


def exchange(steps: int = 3) -> list:
    """Runs on 2 ranks; returns what each received per step, on the host."""
    device = get_accelerator().torch_device(comm.get_local_rank())
    transport, rank, got = Transport(device), comm.get_rank(), []
    act, grad = ("act", 0, "train"), ("grad", 1, "train")
    for step in range(steps):
        if rank == 0:
            x = (torch.arange(6.0, device=device).reshape(2, 3) * (step + 1)).requires_grad_()
            mask = torch.tensor([[True, False, True]], device=device)
            ids = torch.arange(5, dtype=torch.int16, device=device) + step
            _, g = transport.run([SendOp(act, (x, mask, ids), 1), RecvOp(grad, 1)])
            got.append([(t.detach().cpu(), t.requires_grad) for t in g])
        else:
            (msg,) = transport.run([RecvOp(act, 0)])
            got.append([(t.detach().cpu(), t.requires_grad) for t in msg])
            transport.run([SendOp(grad, (msg[0].detach() * 2,), 0)])
    return got


def check(results, steps: int = 3) -> None:
    stage0, stage1 = results
    for step in range(steps):
        x = torch.arange(6.0).reshape(2, 3) * (step + 1)
        (h, h_rg), (m, m_rg), (i, i_rg) = stage1[step]
        assert torch.equal(h, x) and h_rg  # a float that required grad arrives requiring grad
        assert m.dtype == torch.bool and torch.equal(m, torch.tensor([[True, False, True]])) and not m_rg
        assert i.dtype == torch.int16 and torch.equal(i, torch.arange(5, dtype=torch.int16) + step) and not i_rg
        ((g, g_rg),) = stage0[step]  # a one-tensor tuple stays a tuple
        assert torch.equal(g, 2 * x) and not g_rg


@pytest.mark.timeout(60)
def test_tuples_of_mixed_dtypes_cross_between_two_ranks():
    check(run_distributed(exchange, 2, timeout=50))
