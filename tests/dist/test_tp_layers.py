"""The conjugate collectives, the parallel layers and vocab-parallel cross-entropy at tp=2, each against
the plain single-tensor computation (values and gradients). One spawn runs every check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from zerospeed import comm

N, V, IGNORE = 12, 37, -100


def _data():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, V, generator=g) * 3
    target = torch.randint(0, V, (N,), generator=g)
    target[[1, 5, 6]] = IGNORE
    x = torch.randn(2, 4, 6, generator=g)
    return logits, target, x


def _mappings(rank, x):
    from zerospeed.parallel.tensor import mappings as M

    out = {}
    a = x.clone().requires_grad_()
    (M.copy_to_tensor_region(a, None) * (rank + 1)).sum().backward()
    out["copy"] = a.grad
    a = x.clone().requires_grad_()
    y = M.reduce_from_tensor_region(a * (rank + 1), None)
    y.sum().backward()
    out["reduce"] = (y.detach(), a.grad)
    a = x.clone().requires_grad_()
    (M.scatter_to_tensor_region(a, None) * (rank + 1)).sum().backward()
    out["scatter"] = a.grad
    part = x[..., [slice(0, 4), slice(4, 6)][rank]].clone().requires_grad_()  # uneven: 4 | 2
    y = M.gather_from_tensor_region(part, None, sizes=[4, 2])
    (y * torch.arange(6.0)).sum().backward()
    out["gather"] = (y.detach(), part.grad)
    a = x.clone().requires_grad_()
    y = M.reduce_scatter_to_sequence(a * (rank + 1), None, dim=1)
    (y * (rank + 1)).sum().backward()
    out["reduce_scatter"] = (y.detach(), a.grad)
    chunk = x.chunk(2, dim=1)[rank].clone().requires_grad_()
    y = M.gather_from_sequence(chunk, None, dim=1)
    (y * (rank + 1)).sum().backward()
    out["gather_seq"] = (y.detach(), chunk.grad)
    w = x[0].clone().requires_grad_()
    (M.sum_over_replicas(w, None, slot=0, slots=1) * (rank + 1)).sum().backward()
    out["replicas"] = w.grad
    return out


def _layers(x):
    from zerospeed.parallel.tensor import ColumnParallelLinear, RowParallelLinear, full_state_dict

    torch.manual_seed(5)
    ref_col, ref_row = nn.Linear(6, 8), nn.Linear(6, 3)
    col = ColumnParallelLinear.from_linear(ref_col, group=None, gather_output=True)
    row = RowParallelLinear.from_linear(ref_row, group=None, input_is_parallel=False)
    a = x.clone().requires_grad_()
    y = col(a).sum() + row(a).pow(2).sum()
    y.backward()
    grads = {
        "col.weight": col.weight.grad,
        "col.bias": col.bias.grad,
        "row.weight": row.weight.grad,
        "row.bias": row.bias.grad,
    }
    torch.manual_seed(7)
    built = ColumnParallelLinear(6, 8, group=None)  # initialised as the full layer, then sliced
    return {"y": y.detach(), "x_grad": a.grad, "grads": grads, "built": full_state_dict(built, None)}


def _cross_entropy(rank, logits, target):
    from zerospeed.parallel.tensor import vocab_parallel_cross_entropy
    from zerospeed.parallel.tensor.partition import balanced_range

    start, n = balanced_range(V, 2, rank)
    out = {"start": start}
    saved: list[tuple[int, ...]] = []
    for reduction in ("mean", "sum", "none"):
        local = logits[:, start : start + n].clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss = vocab_parallel_cross_entropy(
                local, target, None, vocab_start=start, ignore_index=IGNORE, reduction=reduction
            )
        weight = torch.linspace(0.5, 2.0, N) if reduction == "none" else 1.0
        (loss * weight).sum().backward()
        out[reduction] = (loss.detach(), local.grad)
    out["saved"] = saved
    return out


def _all_checks():
    rank = comm.get_rank()
    logits, target, x = _data()
    return {"mappings": _mappings(rank, x), "layers": _layers(x), "ce": _cross_entropy(rank, logits, target)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_checks, 2, timeout=90)


@pytest.mark.timeout(120)
def test_conjugate_collectives(runs):
    _, _, x = _data()
    halves = [slice(0, 3), slice(3, 6)]
    for rank, res in enumerate(runs):
        m = res["mappings"]
        torch.testing.assert_close(m["copy"], torch.full_like(x, 3.0))  # sum over ranks of (rank + 1)
        torch.testing.assert_close(m["reduce"][0], 3 * x)
        torch.testing.assert_close(m["reduce"][1], torch.full_like(x, rank + 1.0))
        want = torch.cat([torch.full_like(x[..., h], r + 1.0) for r, h in enumerate(halves)], -1)
        torch.testing.assert_close(m["scatter"], want)
        torch.testing.assert_close(m["gather"][0], x)
        torch.testing.assert_close(m["gather"][1], torch.arange(6.0)[[slice(0, 4), slice(4, 6)][rank]].expand(2, 4, -1))
        torch.testing.assert_close(m["reduce_scatter"][0], (3 * x).chunk(2, dim=1)[rank])
        grad = torch.cat([torch.full_like(x.chunk(2, 1)[r], r + 1.0) for r in range(2)], 1) * (rank + 1)
        torch.testing.assert_close(m["reduce_scatter"][1], grad)
        torch.testing.assert_close(m["gather_seq"][0], x)
        torch.testing.assert_close(m["gather_seq"][1], torch.full_like(x.chunk(2, 1)[rank], 3.0))
        torch.testing.assert_close(m["replicas"], torch.full_like(x[0], 3.0))


@pytest.mark.timeout(120)
def test_parallel_linears_equal_nn_linear(runs):
    _, _, x = _data()
    torch.manual_seed(5)
    ref_col, ref_row = nn.Linear(6, 8), nn.Linear(6, 3)
    a = x.clone().requires_grad_()
    y = ref_col(a).sum() + ref_row(a).pow(2).sum()
    y.backward()
    torch.manual_seed(7)
    built = nn.Linear(6, 8)
    for rank, res in enumerate(runs):
        r = res["layers"]
        torch.testing.assert_close(r["y"], y.detach())
        torch.testing.assert_close(r["x_grad"], a.grad)
        rows, cols = slice(4 * rank, 4 * rank + 4), slice(3 * rank, 3 * rank + 3)
        torch.testing.assert_close(r["grads"]["col.weight"], ref_col.weight.grad[rows])
        torch.testing.assert_close(r["grads"]["col.bias"], ref_col.bias.grad[rows])
        torch.testing.assert_close(r["grads"]["row.weight"], ref_row.weight.grad[:, cols])
        torch.testing.assert_close(r["grads"]["row.bias"], ref_row.bias.grad)
        torch.testing.assert_close(r["built"]["weight"], built.weight.detach())
        torch.testing.assert_close(r["built"]["bias"], built.bias.detach())


@pytest.mark.timeout(120)
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(runs):
    logits, target, _ = _data()
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        loss = F.cross_entropy(full, target, ignore_index=IGNORE, reduction=reduction)
        weight = torch.linspace(0.5, 2.0, N) if reduction == "none" else 1.0
        (loss * weight).sum().backward()
        for res in runs:
            got, grad = res["ce"][reduction]
            start = res["ce"]["start"]
            torch.testing.assert_close(got, loss.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, full.grad[:, start : start + grad.shape[1]], rtol=1e-6, atol=1e-6)
        assert float(full.grad[[1, 5, 6]].abs().sum()) == 0.0  # ignored targets: no gradient
    for res in runs:  # what the backward keeps is this rank's vocabulary slice, never the full vocabulary
        widths = {shape[-1] for shape in res["ce"]["saved"] if len(shape) == 2}
        assert widths and max(widths) <= (V + 1) // 2, res["ce"]["saved"]
