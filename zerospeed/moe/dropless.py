"""Dropless expert parallelism with exact token counts: uneven all-to-alls instead of a padded buffer.

Note [dropless exchange]: DeepSpeed's dropless mode pads every expert's buffer to the largest count
on any rank of the expert-parallel group (one all-reduce) and sends the whole `[E, C, M]` buffer.
Here a dropless layer sends only the tokens routed: each rank packs expert e's first `n_e` slots
(every routed token, in slot order), tells each destination how many rows of each of its experts
are coming (an all-to-all of E integers), and sends uneven slices; every local expert then runs on
the concatenation of its tokens from all ranks, and the outputs travel back by the conjugate
exchange. The result equals the padded computation exactly (padding rows carry weight 0); the bytes
are 2 x (routed tokens leaving the rank) x M x element size per forward, plus the counts.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed import comm
from zerospeed.comm.functional import all_to_all


def exchange_counts(counts_E: torch.Tensor, group, ep: int) -> torch.Tensor:
    """[ep, local] counts received: row r = how many slots of each local expert rank r sends here."""
    send = counts_E.to(torch.int64).reshape(ep, -1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv


def run_dropless(
    slots_ECM: torch.Tensor, counts_E: list[int], experts: nn.ModuleList, group, ep: int, around_experts
) -> torch.Tensor:
    """The experts' outputs for `slots_ECM` ([E, C, M], expert e's first counts_E[e] slots used), in the
    same layout (unused slots zero). `around_experts(fn, x)` wraps the expert computation (the gradient
    scale of Note [expert gradient scale])."""
    E, C, M = slots_ECM.shape
    local = E // ep
    packed = torch.cat([slots_ECM[e, : counts_E[e]] for e in range(E)])
    send_rows = [sum(counts_E[j * local : (j + 1) * local]) for j in range(ep)]
    recv_RL = exchange_counts(torch.tensor(counts_E), group, ep)
    recv_rows = recv_RL.sum(dim=1).tolist()
    received = all_to_all(packed, group, output_split_sizes=recv_rows, input_split_sizes=send_rows)

    def compute(rows: torch.Tensor) -> torch.Tensor:
        pieces = list(rows.split(recv_RL.flatten().tolist()))  # source-major, then local expert
        outs = [None] * len(pieces)
        for j, expert in enumerate(experts):
            mine = [pieces[r * local + j] for r in range(ep)]
            y = expert(torch.cat(mine))
            y = y[0] if isinstance(y, tuple) else y
            for r, part in enumerate(y.split([len(m) for m in mine])):
                outs[r * local + j] = part
        return torch.cat(outs)

    out_rows = around_experts(compute, received)
    returned = all_to_all(out_rows, group, output_split_sizes=send_rows, input_split_sizes=recv_rows)
    chunks = returned.split(counts_E)
    return torch.stack([torch.cat([chunk, chunk.new_zeros(C - len(chunk), M)]) for chunk in chunks])
