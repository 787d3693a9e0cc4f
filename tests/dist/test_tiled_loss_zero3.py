"""ALST's tiled loss (`tiled_cross_entropy_sum`) under ZeRO-3, against one plain PyTorch process that
computes the full logits (Note [tiled compute under ZeRO-3] in zerospeed/sequence/tiled.py).

The loss uses the output head's weight inside the model's forward, outside the head's own forward, so
stage 3 gathers it around the model's forward when the model declares the use with
`zero.register_external_parameter`, as DeepSpeed asks of any parameter used outside its module; an
undeclared use is gathered when the forward reads it, as DeepSpeed does too (Note [undeclared external
parameters], zero/stage3/external.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed

VOCAB, WIDTH, SEQ, BATCH, STEPS, WORLD = 96, 32, 24, 2, 3, 2
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class TinyLM(nn.Module):
    def __init__(self, tiled: bool, declare: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.tiled = tiled
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tiled and declare:
            from zerospeed import zero

            zero.register_external_parameter(self, self.head.weight)

    def forward(self, ids, labels):
        h = self.body(self.emb(ids))
        if self.tiled:
            from zerospeed.sequence.tiled import tiled_cross_entropy_sum

            return tiled_cross_entropy_sum(h, self.head.weight, labels, shards=4) / labels.numel()
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()


def _batches():
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (WORLD * BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (WORLD * BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _reference():
    """One process, the full logits, the global batch: per step each rank's share of the loss, then
    the final weights."""
    model = TinyLM(tiled=False)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for ids, labels in _batches():
        halves = [model(ids[r * BATCH : (r + 1) * BATCH], labels[r * BATCH : (r + 1) * BATCH]) for r in range(WORLD)]
        losses.append([h.item() for h in halves])
        opt.zero_grad()
        (sum(halves) / WORLD).backward()
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero3(declare: bool = True):
    import zerospeed
    from zerospeed import comm, zero

    rank = comm.get_rank()
    with zero.Init():
        model = TinyLM(tiled=True, declare=declare)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for ids, labels in _batches():
        loss = engine(ids[rank * BATCH : (rank + 1) * BATCH], labels[rank * BATCH : (rank + 1) * BATCH])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine._zero3_consolidated_16bit_state_dict()


@pytest.mark.timeout(180)
def test_tiled_loss_at_zero3_equals_the_full_logits_in_one_process():
    ref_losses, ref_weights = _reference()
    ranks = run_distributed(_zero3, WORLD, timeout=150)
    for rank, (losses, _) in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor([s[rank] for s in ref_losses]), rtol=1e-5, atol=1e-6
        )
    weights = ranks[0][1]
    assert set(weights) == set(ref_weights)
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(180)
def test_an_undeclared_head_weight_is_gathered_on_use_and_trains_the_same():
    """DeepSpeed gathers a parameter read during a forward outside its module's (and trains the model);
    so does zerospeed since issue 49 (Note [undeclared external parameters], zero/stage3/external.py)."""
    ref_losses, ref_weights = _reference()
    ranks = run_distributed(_zero3, WORLD, False, timeout=150)
    for rank, (losses, _) in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor([s[rank] for s in ref_losses]), rtol=1e-5, atol=1e-6
        )
    for k, v in ref_weights.items():
        torch.testing.assert_close(ranks[0][1][k], v, rtol=1e-5, atol=1e-6, msg=k)
