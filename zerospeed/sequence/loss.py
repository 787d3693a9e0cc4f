"""The loss of a sequence split across ranks, combined exactly as the unsharded mean.

Note [sequence-parallel loss]: with the sequence split over P ranks, rank r sees the sum S_r of its
tokens' losses and its count n_r of non-ignored labels (uneven: padding and -100 labels fall where they
fall). The unsharded loss is sum(S_r) / sum(n_r) — not the mean of the ranks' means. Every rank computes
that value (one differentiable all-reduce of S_r, one plain all-reduce of n_r); the all-reduce's adjoint
sums the P identical upstream gradients, and the engine averages gradients over the P sequence ranks
(they are part of its data x sequence reduction group), so each parameter receives exactly the gradient
of the unsharded mean. The user writes nothing: `sequence_parallel_cross_entropy` and the transformers
integration's loss function do this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerospeed import comm
from zerospeed.comm.functional import all_reduce_sum


def mean_over_sequence(local_sum: torch.Tensor, local_count: torch.Tensor | int, group) -> torch.Tensor:
    """sum of `local_sum` over `group` / sum of `local_count` over `group` (Note [sequence-parallel loss]);
    0 when no rank has a token to count."""
    count = torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device).clone()
    comm.all_reduce(count, op="sum", group=group)
    total = all_reduce_sum(local_sum, group)
    return total / count.clamp(min=1).to(total.dtype)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor, shift_labels: torch.Tensor, group, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over every non-ignored token of the whole (sharded) sequence, on every rank.

    `logits` [..., vocab] are this rank's positions, `shift_labels` [...] their targets, already shifted
    on the full sequence (`shard_sequence_batch` makes them), so no token is lost at a shard boundary.
    Computed in fp32."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    labels = shift_labels.reshape(-1).to(flat.device)
    local = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return mean_over_sequence(local, (labels != ignore_index).sum(), group)
