"""Stage 3 frees what it releases: full weights that autograd saved for backward (nn.Linear keeps a
transposed view of its weight) cost nothing between a unit's forward and its backward
(Note [freed in place] in zero/stage3/flat_param.py). Checked by a census of the storages autograd
saved during a forward, against the same census of the plain single-process model."""
import pytest
import torch

from zerospeed.testing import run_distributed

WIDTH, LAYERS, BATCH = 256, 6, 8


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _saved_storage_bytes(model, x):
    """Forward under a pack hook; returns (loss, {storage ptr: its size *now*}) of every saved tensor."""
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        saved[id(s)] = s
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    return loss, saved


def _probe():
    import zerospeed
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    plain = _mlp()
    _, saved = _saved_storage_bytes(plain, x)
    weights = {p.untyped_storage().data_ptr() for p in plain.parameters()}
    plain_activations = sum(s.nbytes() for s in saved.values() if s.data_ptr() not in weights)
    plain_weights = sum(s.nbytes() for s in saved.values() if s.data_ptr() in weights)

    model = _mlp()
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                 "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loss, saved = _saved_storage_bytes(engine, x)
    held = sum(s.nbytes() for s in saved.values())
    engine.backward(loss)  # the re-gathered weights give the plain gradients
    engine.step()
    return {"plain_activations": plain_activations, "plain_weights": plain_weights, "held": held}


@pytest.mark.timeout(120)
def test_released_units_hold_no_memory_through_autograd():
    for r in run_distributed(_probe, 2, timeout=100):
        # the plain model's autograd keeps every weight but the first (its input needs no gradient)
        assert r["plain_weights"] == (LAYERS - 1) * WIDTH * WIDTH * 4
        # stage 3 keeps the same activations and no weights (every unit is released after its forward)
        assert r["held"] == r["plain_activations"], r
