"""`nn.Embedding(sparse=True)` under the engine (Note [sparse gradients] in zero/reducer.py): its sparse COO
gradient is added into the flat buffer and reduced like the others, at ZeRO 0-3 on 2 ranks, against one
plain PyTorch process whose optimizer takes the sparse gradients themselves (torch's SGD and Adagrad
accept them). Losses and final weights agree within 1e-6 over 6 steps. Before, the first backward
crashed (a sparse gradient has no storage to compare with the buffer's slot). DeepSpeed reduces such
gradients sparse and needs no config flag for them; neither does zerospeed."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import reference_train

WORLD, MICRO, GAS, STEPS, VOCAB = 2, 2, 2, 6, 20
OPTIMIZERS = {"SGD": {"lr": 0.5}, "Adagrad": {"lr": 0.1}}


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids, y):
        return ((self.head(self.emb(ids).mean(1)).squeeze(-1) - y) ** 2).mean()


def _model():
    torch.manual_seed(0)
    return Bag()


def _batches():
    g = torch.Generator().manual_seed(2)
    n = WORLD * GAS * MICRO
    return [(torch.randint(0, VOCAB, (n, 3), generator=g), torch.randn(n, generator=g)) for _ in range(STEPS)]


def _train(stage: int, opt: str):
    import zerospeed
    from harness.reference import engine_global_step
    from zerospeed import comm

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": opt, "params": OPTIMIZERS[opt]},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    losses = [engine_global_step(engine, batch, WORLD, GAS, comm.get_rank()) for batch in _batches()]
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights}


def _runs():
    return {(stage, opt): _train(stage, opt) for stage in (0, 1, 2, 3) for opt in OPTIMIZERS}


@pytest.mark.timeout(240)
def test_sparse_embedding_gradients_train_like_plain_pytorch_at_every_stage():
    results = run_distributed(_runs, WORLD, timeout=200)
    for opt, params in OPTIMIZERS.items():
        model = _model()
        optimizer = getattr(torch.optim, opt)(model.parameters(), **params)
        ref = reference_train(model, optimizer, _batches(), world_size=WORLD, grad_accum=GAS)
        assert model.emb.weight.grad is None or model.emb.weight.grad.is_sparse  # the reference took sparse ones
        for stage in (0, 1, 2, 3):
            got = results[0][stage, opt]
            assert max(abs(a - b) for a, b in zip(got["losses"], ref)) <= 1e-6, (stage, opt, got["losses"], ref)
            for k, v in model.state_dict().items():
                torch.testing.assert_close(got["weights"][k], v, atol=1e-6, rtol=0, msg=f"ZeRO-{stage} {opt} {k}")
