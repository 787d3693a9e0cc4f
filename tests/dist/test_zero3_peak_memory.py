"""Stage 3 frees what it releases: full weights that autograd saved for backward (nn.Linear keeps a
transposed view of its weight) cost nothing between a unit's forward and its backward
(Note [freed in place] in zero/stage3/flat_param.py). Checked by a census of the storages autograd
saved during a forward, against the same census of the plain single-process model."""

import pytest
import torch

from harness import run_distributed

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
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0,
        },
    }
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


# -- a tied head (Note [tied uses] in zero/stage3/strategy.py) ------------------------------------------
VOCAB, EMBD = 4096, 256  # the tied weight is 2^20 elements: at least a reduce bucket, so it travels alone


def _tied_gpt():
    from zoo.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=EMBD))


def _tied_probe():
    import zerospeed
    from harness import census
    from zerospeed.utils import safe_get_local_grad

    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))  # the same on both ranks
    # plain PyTorch, the head untied from the embedding: each use's share of the tied gradient
    plain = _tied_gpt()
    plain.lm_head.weight = torch.nn.Parameter(plain.wte.weight.detach().clone())
    plain(x, x).backward()
    chunk = VOCAB * EMBD // torch.distributed.get_world_size()  # this rank's piece of the flat weight
    lo = torch.distributed.get_rank() * chunk
    head_share = plain.lm_head.weight.grad.reshape(-1)[lo : lo + chunk].clone()
    full = head_share + plain.wte.weight.grad.reshape(-1)[lo : lo + chunk]
    del plain  # (the census below counts whole-weight-sized tensors)

    model = _tied_gpt()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "overlap_comm": False},
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    weight = engine.module.wte.weight
    seen = {}

    def before_first_block(module, grad_output):  # after the head's backward, before the embedding's
        seen["grad"] = safe_get_local_grad(weight).clone()
        seen["full_size"] = sum(1 for n in census.live_tensor_storages().values() if n == VOCAB * EMBD * 4)

    engine.module.blocks[0].register_full_backward_pre_hook(before_first_block)
    engine.backward(engine(x, x))
    end = safe_get_local_grad(weight).clone()
    engine.step()
    return {
        "mid_error": (seen["grad"] - head_share).abs().max().item(),
        "end_error": (end - full).abs().max().item(),
        "full_size": seen["full_size"],
        "scale": head_share.abs().max().item(),
    }


@pytest.mark.timeout(120)
def test_tied_head_reduces_its_share_and_frees_the_gathered_weight_before_the_embedding():
    for r in run_distributed(_tied_probe, 2, timeout=100):
        assert r["scale"] > 1e-4, r  # the head's share is not trivially zero
        # by the first block's backward, this rank's gradient chunk holds exactly the head's reduced share
        assert r["mid_error"] <= 1e-6, r
        # and no tensor the size of the whole tied weight is alive: neither the gathered weight nor its
        # full gradient (before Note [tied uses] both were, until the embedding's backward)
        assert r["full_size"] == 0, r
        assert r["end_error"] <= 1e-6, r  # the two shares add up to the plain tied gradient
