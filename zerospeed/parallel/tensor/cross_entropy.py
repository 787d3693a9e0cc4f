"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

Note [vocab-parallel cross-entropy]: with logits z split over ranks by vocabulary rows,
    loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v
needs only three scalars per token from the other ranks: the global max (all-reduce max), the sum of
the shifted exponentials (all-reduce sum), and the target's shifted logit, which exactly one rank owns
(all-reduce sum of a tensor that is zero elsewhere). The gradient with respect to the local logits is
local: softmax_v - [v == target], scaled by the incoming gradient. So per token the traffic is three
floats, whatever the vocabulary; the largest tensor is the local [tokens, vocab/tp] shard.
"""

from __future__ import annotations

import torch

from zerospeed.comm import backend


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_N, group, vocab_start, ignore_index):
        z = logits_NV.float()
        m_N = z.max(dim=-1).values
        backend.all_reduce(m_N, op="max", group=group)
        z = z - m_N.unsqueeze(-1)  # a new tensor: the input logits are left untouched
        local = target_N - vocab_start
        owned = (local >= 0) & (local < z.shape[-1]) & (target_N != ignore_index)
        local = local.masked_fill(~owned, 0)
        picked_N = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp_NV = z.exp_()
        sum_N = exp_NV.sum(dim=-1)
        both = torch.stack([sum_N, picked_N])  # one all-reduce for the two sums
        backend.all_reduce(both, group=group)
        sum_N, picked_N = both[0], both[1]
        ignored = target_N == ignore_index
        loss_N = (sum_N.log() - picked_N).masked_fill(ignored, 0.0)
        softmax_NV = exp_NV.div_(sum_N.unsqueeze(-1))
        ctx.save_for_backward(softmax_NV, local, owned, ignored)
        ctx.in_dtype = logits_NV.dtype
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        softmax_NV, local, owned, ignored = ctx.saved_tensors
        grad_NV = softmax_NV.clone()
        rows = torch.arange(grad_NV.shape[0], device=grad_NV.device)
        grad_NV[rows, local] -= owned.to(grad_NV.dtype)
        grad_NV.mul_(grad_N.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad_NV.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    group,
    *,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`F.cross_entropy(full_logits, target, ignore_index=..., reduction=...)` computed from this rank's
    vocabulary shard `logits_local` [..., V/tp]; Note [vocab-parallel cross-entropy].

    `vocab_start` is the first vocabulary id this rank holds (a VocabParallelEmbedding's or tied head's
    `vocab_start`); default rank * V_local, right for equal shards. reduction: mean (over targets that
    are not ignored) | sum | none. Every rank returns the same value.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits_local.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits_local.shape)} and target {tuple(target.shape)} disagree: the "
            "logits need one more (vocabulary) dimension than the target"
        )
    if vocab_start is None:
        vocab_start = backend.get_rank(group) * logits_local.shape[-1]
    shape = target.shape
    loss = _VocabParallelCE.apply(
        logits_local.reshape(-1, logits_local.shape[-1]), target.reshape(-1), group, vocab_start, ignore_index
    )
    if reduction == "none":
        return loss.view(shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


class VocabParallelCausalLMLoss:
    """transformers' causal-LM loss (`ForCausalLMLoss`: shift the labels by one, ignore -100, mean — or
    sum / num_items_in_batch) over vocabulary-sharded logits. AutoTP sets it as the model's
    `loss_function`, so `model(input_ids, labels=...)` keeps returning the loss a plain model would."""

    def __init__(self, group, vocab_start: int):
        self.group, self.vocab_start = group, vocab_start

    def __call__(
        self,
        logits,
        labels,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index: int = -100,
        shift_labels=None,
        **kwargs,
    ):
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        flat = logits.reshape(-1, logits.shape[-1])
        if num_items_in_batch is None:
            return vocab_parallel_cross_entropy(
                flat, target, self.group, vocab_start=self.vocab_start, ignore_index=ignore_index
            )
        total = vocab_parallel_cross_entropy(
            flat, target, self.group, vocab_start=self.vocab_start, ignore_index=ignore_index, reduction="sum"
        )
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
