"""torch.func transforms on an engine's model at ZeRO stages 0, 1 and 2 (2 ranks) give what the same
transform gives on a plain PyTorch copy of the model (DeepSpeed 0.19's #8026), and leave training
untouched: the transforms run in the middle of every accumulation window, and the run still equals a
plain single-process PyTorch run step for step.

Covered: `functional_call(engine.module, params, x)` with parameters other than the module's,
per-sample gradients `vmap(grad(loss))` over `functional_call`, and the transforms through the engine
itself — `grad`, `grad_and_value`, `jacrev`, `vmap(grad(...))` and `vmap` of `engine(x)`. The gradient
a transform returns is not divided by `gradient_accumulation_steps` (that is `engine.backward`'s)."""

import pytest
import torch
from torch.func import functional_call, grad, grad_and_value, jacrev, vmap

from harness import reference_train, run_distributed, split_global_batch

IN, HIDDEN, OUT = 6, 10, 3
WORLD, MICRO, GAS, STEPS = 2, 4, 2, 3
SGD = {"lr": 0.05, "momentum": 0.9}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _batches():
    g = torch.Generator().manual_seed(1)
    n = WORLD * GAS * MICRO
    return [(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)) for _ in range(STEPS)]


def _transforms(module, call, x, y):
    """Every transform's result, for `module` (its parameters' names) and `call` (x -> output)."""
    params = {k: v.detach() + 0.01 for k, v in module.named_parameters()}  # not the module's own values

    def sample_loss(p, xi, yi):
        return (functional_call(module, p, (xi.unsqueeze(0),)) - yi).square().sum()

    out = {"functional_call": functional_call(module, params, (x,))}
    out.update({f"per_sample/{k}": v for k, v in vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y).items()})
    out["grad_x"] = grad(lambda xi: call(xi).tanh().sum())(x)
    g, v = grad_and_value(lambda xi: call(xi).square().sum())(x)
    out["grad_and_value"], out["value"] = g, v
    out["jacrev"] = jacrev(call)(x[0])
    out["vmap_grad"] = vmap(grad(lambda xi: call(xi).sin().sum()))(x)
    out["vmap"] = vmap(call)(x)
    return out


def _errors(engine, x, y):
    """max |transform on the engine - transform on a plain copy with the engine's current weights|."""
    plain = _model()
    plain.load_state_dict({k: v.detach() for k, v in engine.module.state_dict().items()})
    ours = _transforms(engine.module, engine, x, y)
    ref = _transforms(plain, plain, x, y)
    assert ours.keys() == ref.keys()
    return {k: (ours[k] - ref[k]).abs().max().item() for k in ref}


def _probe(stage: int):
    import zerospeed

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": SGD},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = torch.distributed.get_rank()
    errors, losses = [], []
    for x, y in _batches():
        for m, (mx, my) in enumerate(split_global_batch((x, y), WORLD, GAS, rank)):
            loss = _loss(engine, mx, my)
            if m == 0:  # in the middle of the window: before this micro-step's backward and after
                errors.append(_errors(engine, mx, my))
            engine.backward(loss)
            errors.append(_errors(engine, mx, my))
            engine.step()
            losses.append(loss.item())
    return {"errors": errors, "losses": losses, "final": [p.detach().clone() for p in engine.module.parameters()]}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_torch_func_on_engine_equals_plain_pytorch(stage):
    results = run_distributed(_probe, WORLD, stage, timeout=120)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    ref_losses = reference_train(model, opt, _batches(), world_size=WORLD, grad_accum=GAS, loss_fn=_loss, clip=1.0)
    print(
        f"stage {stage}: max |torch.func on the engine - on plain PyTorch| =",
        max(max(e.values()) for r in results for e in r["errors"]),
    )
    for r in results:
        assert len(r["errors"]) == 3 * STEPS
        for errs in r["errors"]:
            assert len(errs) == 11 and max(errs.values()) <= 1e-6, errs
        for got, want in zip(r["final"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)
    # each rank's micro-batch losses, averaged over ranks and micro-steps, are the reference's step losses
    for s in range(STEPS):
        mean = sum(sum(r["losses"][s * GAS : (s + 1) * GAS]) for r in results) / (WORLD * GAS)
        assert abs(mean - ref_losses[s]) <= 1e-5, (s, mean, ref_losses[s])


def _stage3_probe():
    import zerospeed

    model = _model()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": SGD}}
    cfg["zero_optimization"] = {"stage": 3}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(MICRO, IN)
    try:
        grad(lambda xi: engine(xi).sum())(x)
    except NotImplementedError as e:
        message = str(e)
    else:
        message = None
    loss = engine(x).sum()  # the refused call left the engine as it was
    engine.backward(loss)
    engine.step()
    return message


@pytest.mark.timeout(120)
def test_torch_func_through_a_stage3_engine_is_refused_clearly():
    for message in run_distributed(_stage3_probe, WORLD, timeout=100):
        assert message is not None and "ZeRO stage 3" in message and "stage 0-2" in message
