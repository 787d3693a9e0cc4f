"""An engine the user drops frees everything it allocated (Note [weak tensor hooks], zero/reducer.py;
the stage-3 owners in the parameter tags, Note [owners held weakly] in zero/tags.py).

Measured independently of zerospeed by a census of every live tensor storage the garbage collector
knows (harness.census) before the model is built and after the last reference to the model,
the engine and the optimizer is dropped. (Not the profiler's allocator record: frees that gloo's
worker threads make land in it late or not at all, at random.) A sweep that
builds one engine after another in a process (hyperparameter search, tests, notebooks) would otherwise
keep every earlier engine's model, gradients and optimizer states alive.
"""

import pytest
import torch

from harness import run_distributed

CONFIGS = {  # name: zero_optimization, built under zero.Init
    "stage 0": ({"stage": 0}, False),
    "stage 1": ({"stage": 1}, False),
    "stage 2": ({"stage": 2}, False),
    "stage 2, optimizer offload": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, False),
    "stage 3": ({"stage": 3}, False),
    "stage 3 under zero.Init": ({"stage": 3}, True),
    "stage 3 under zero.Init, again": ({"stage": 3}, True),
}


def _left_after_drop():
    import zerospeed
    from harness import census
    from zerospeed import zero
    from zoo.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=128)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, (zcfg, init) in CONFIGS.items():
        before = census.live_tensor_bytes()
        torch.manual_seed(0)
        if init:
            with zero.Init():
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        ds = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zcfg,
        }
        engine, optimizer, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        for _ in range(2):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        held = census.live_tensor_bytes() - before
        del model, engine, optimizer, loss
        out[name] = (census.live_tensor_bytes() - before, held)
    return out


@pytest.mark.timeout(240)
def test_a_dropped_engine_frees_its_model_gradients_and_optimizer_states():
    for rank, left in enumerate(run_distributed(_left_after_drop, 2, timeout=200)):
        for name, (remaining, held) in left.items():
            assert held > 10**6, (rank, name, held)  # the census sees the engine's states while it lives
            assert remaining <= 0, (rank, name, remaining, held)
