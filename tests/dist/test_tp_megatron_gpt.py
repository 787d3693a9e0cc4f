"""Megatron-style tensor parallelism against one plain PyTorch process.

A tiny GPT written twice: `RefGPT` in plain PyTorch, and `TPGPT` from the parallel layers (fused qkv
column-parallel with each rank's heads of q, k and v; row-parallel attention output; column -> row
MLP; vocab-parallel embedding tied to the output head; vocab-parallel cross-entropy), built from the
reference's weights. Each tp rank runs a plain torch.optim optimizer on its own shards — tensor-parallel
ranks need no gradient reduction — and after 10 steps the gathered weights must equal the reference's.
The vocabulary (37) does not divide by 2 or 4, so the uneven vocabulary split is exercised too.

One spawn per world size runs every case (processes are the expensive part on two cores).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    full_state_dict,
    grad_norm_squared,
    param_layouts,
    vocab_parallel_cross_entropy,
)
from zerospeed.parallel.tensor.partition import fused_spec
from zerospeed.parallel.tensor.volume import model_step_bytes

V, D, H, L, B, T, STEPS = 37, 16, 4, 2, 2, 8, 10


class RefBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = (
            nn.Linear(D, 3 * D, bias=False),
            nn.Linear(D, D),
        )  # a k bias has no gradient: Adam would amplify noise
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)


class RefGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(RefBlock() for _ in range(L))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids, target):
        x = self.wte(ids) + self.wpe.weight
        for b in self.blocks:
            q, k, v = b.qkv(b.ln1(x)).split(D, dim=-1)
            x = x + b.proj(_attend(q, k, v))
            x = x + b.out(F.gelu(b.fc(b.ln2(x))))
        return F.cross_entropy((self.ln_f(x) @ self.wte.weight.T).flatten(0, 1), target.flatten())


def _attend(q, k, v):
    """Causal attention over heads of size D // H; the head count is whatever the width holds."""
    shape = (*q.shape[:-1], -1, D // H)
    q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


class TPGPT(nn.Module):
    """RefGPT with the parallel layers; `sp`: Megatron sequence parallelism (LayerNorm, residual and
    dropout regions hold this rank's slice of the sequence, dim 1)."""

    def __init__(self, ref: RefGPT, group, sp: bool = False):
        super().__init__()
        tp, self.group, self.sp = comm.get_world_size(group), group, sp
        self.rank = comm.get_rank(group)
        seq = {"sequence_parallel": sp, "sequence_dim": 1}
        self.wte = VocabParallelEmbedding.from_embedding(ref.wte, group=group, **seq)
        self.wpe = nn.Parameter(ref.wpe.weight.detach().clone())
        self.blocks = nn.ModuleList()
        qkv_specs = tuple(fused_spec([D, D, D], tp, r, unit=D // H) for r in range(tp))
        for rb in ref.blocks:
            b = nn.Module()
            b.ln1, b.ln2 = _copy_ln(rb.ln1), _copy_ln(rb.ln2)
            b.qkv = ColumnParallelLinear.from_linear(rb.qkv, group=group, specs=qkv_specs, gather_output=False, **seq)
            b.proj = RowParallelLinear.from_linear(rb.proj, group=group, input_is_parallel=True, **seq)
            b.fc = ColumnParallelLinear.from_linear(rb.fc, group=group, gather_output=False, **seq)
            b.out = RowParallelLinear.from_linear(rb.out, group=group, input_is_parallel=True, **seq)
            self.blocks.append(b)
        self.ln_f = _copy_ln(ref.ln_f)
        self.head = ColumnParallelLinear.tied_to(self.wte, **seq)

    def forward(self, ids, target):
        pos = self.wpe
        if self.sp:  # this rank's positions
            pos = pos.chunk(comm.get_world_size(self.group))[self.rank]
        x = self.wte(ids) + pos
        for b in self.blocks:
            q, k, v = b.qkv(b.ln1(x)).chunk(3, dim=-1)
            x = x + b.proj(_attend(q, k, v))
            x = x + b.out(F.gelu(b.fc(b.ln2(x))))
        logits = self.head(self.ln_f(x))
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), target.flatten(), self.group, vocab_start=self.wte.vocab_start
        )


def _copy_ln(ln: nn.LayerNorm) -> nn.LayerNorm:
    new = nn.LayerNorm(ln.normalized_shape)
    new.load_state_dict(ln.state_dict())
    return new


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(STEPS)]


def _reference_model() -> RefGPT:
    torch.manual_seed(0)
    return RefGPT()


def _optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.Adam(params, lr=1e-2)


def _train_tp(group, opt_name: str, sp: bool = False):
    model = TPGPT(_reference_model(), group, sp)
    replicated = [p for n, p in model.named_parameters() if param_layouts(model)[n] is None]
    opt = _optimizer(opt_name, model.parameters())
    losses, comm_bytes = [], None
    for step, seq in enumerate(_batches()):
        opt.zero_grad()
        comm.STATS.reset()
        loss = model(seq[:, :-1], seq[:, 1:])
        loss.backward()
        if step == 0:
            comm_bytes = {k: v["payload_bytes"] for k, v in comm.STATS.snapshot().items()}
        if sp:  # Megatron SP: replicated weights saw only this rank's slice of the sequence
            all_reduce_sequence_parallel_grads(replicated, group)
        if step == STEPS - 1:
            norm = float(grad_norm_squared(model, group).sqrt())
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "weights": full_state_dict(model, group),
        "comm": comm_bytes,
        "analytic": model_step_bytes(model, B * T, loss_tokens=B * T),
        "norm": norm,
    }


def reference(opt_name: str):
    model = _reference_model()
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for step, seq in enumerate(_batches()):
        opt.zero_grad()
        loss = model(seq[:, :-1], seq[:, 1:])
        loss.backward()
        if step == STEPS - 1:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), norm


def _all_cases(cases):
    group = ParallelMesh.build(tp=comm.get_world_size()).group("tp")
    return {case: _train_tp(group, *case) for case in cases}


# (optimizer, sequence parallel); the tp=4 cases run in test_tp_four_ranks.py, in one spawn with AutoTP's.
CASES = {2: [("sgd", False), ("adam", False), ("adam", True)], 4: [("adam", False)]}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_cases, 2, CASES[2], timeout=100)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES[2])
def test_megatron_gpt_matches_plain_pytorch(runs, case):
    check_parity(runs, 2, case)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES[2])
def test_comm_bytes_per_step_equal_the_formula(runs, case):
    check_comm_bytes(runs, 2, case)


def check_parity(results, tp, case):
    ref_losses, ref_sd, ref_norm = reference(case[0])
    for rank, res in enumerate(results):
        r = res[case]
        gap = max(abs(a - b) for a, b in zip(r["losses"], ref_losses, strict=True))
        assert gap <= 1e-5, f"tp={tp} {case} rank {rank}: max |dloss| {gap:.2e}"
        assert abs(r["norm"] - ref_norm) <= 1e-5 * max(1.0, ref_norm), (r["norm"], ref_norm)
        got = r["weights"]
        for name, want in ref_sd.items():
            key = "wpe" if name == "wpe.weight" else name
            torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5, msg=f"tp={tp} {case} {name}")
        assert got["head.weight"] is not None and torch.equal(got["head.weight"], got["wte.weight"])


def check_comm_bytes(results, tp, case):
    """Payload bytes counted by the gateway in one forward + backward = docs/tensor_parallel.md's formula."""
    tokens, b = B * T, 4
    if case[1]:  # sequence parallel: every all-reduce of activations becomes a reduce-scatter + all-gather
        act = tokens * D * b
        # per block 4 of each (qkv/fc: fwd gather, bwd reduce-scatter; proj/out: the reverse) + embedding + head
        want = {"reduce_scatter": (4 * L + 2) * act, "all_gather": (4 * L + 2) * act, "all_reduce": 3 * tokens * 4}
    else:
        # per block: fwd all-reduce after proj and out; bwd all-reduce before qkv and fc (inputs of width D);
        # + embedding fwd + tied head bwd; + the loss's three floats per token
        want = {"all_reduce": (4 * L + 2) * tokens * D * b + 3 * tokens * 4}
    for res in results:
        r = res[case]
        assert r["comm"] == want, (r["comm"], want)
        assert r["analytic"] == want, (r["analytic"], want)
