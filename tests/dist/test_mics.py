"""MiCS (`zero_optimization.mics_shard_size`, Note [MiCS] in zero/strategy.py) on 4 ranks: ZeRO-3 partitioned
over shard groups of 2 ranks, replicated across the 2 groups, against one plain PyTorch process.

Checked:
- parity: 10 steps of a GPT (2 accumulation steps, gradient clipping on, so the norm must count each
  chunk once) equal plain AdamW over the same global batches: losses and final weights within 1e-5. This
  holds also with the optimizer offloaded to the CPU, and after a checkpoint saved mid-run is loaded
  into a fresh MiCS engine and into a plain ZeRO-3 engine over all 4 ranks;
- the first step's gradient norm equals the plain process's (1e-5 relative);
- memory: each rank's optimizer holds 1/2 of the model's elements (1/S: between total/2 and total/2 +
  one alignment per unit), where plain ZeRO-3 on the same 4 ranks holds 1/4;
- the groups: parameters are gathered from the rank's own shard group (the first rank of each group
  holds the same chunk).
A reduction that skipped the replica all-reduce would train each shard group on half the data; one that
averaged over 2 instead of 4 would double the gradients (the first step's norm is checked against the
plain one: Adam with clipping is blind to that scale); a norm that counted replicas twice would clip
differently. Each fails.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import engine_global_step, reference_train
from zoo.models import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)  # (an attention
# key bias has a zero gradient up to rounding, which Adam magnifies: no fp32 parity for it anywhere)
WORLD, MICRO, GAS, STEPS, SAVE_AT, TOL = 4, 2, 2, 10, 5, 1e-5
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
CLIP = 0.5


def _batches():
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, CFG["vocab_size"], (WORLD * GAS * MICRO, CFG["block_size"]), generator=g),)
        for _ in range(STEPS)
    ]


def _engine(mics: int, offload: bool = False):
    import zerospeed

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "mics_shard_size": mics}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": zero,
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    return engine, model


def _steps(engine, batches) -> list[float]:
    from zerospeed import comm

    return [engine_global_step(engine, (ids, ids), WORLD, GAS, comm.get_rank()) for (ids,) in batches]


def _weights(model):
    import zerospeed

    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _state_elems(engine) -> int:
    return sum(v.numel() for st in engine.optimizer.state.values() for k, v in st.items() if k == "exp_avg")


def _runs(tmp: str):
    batches = _batches()
    out = {}
    engine, model = _engine(2)
    losses = _steps(engine, batches[:1])
    norm0 = engine.get_global_grad_norm()
    losses += _steps(engine, batches[1:SAVE_AT])
    engine.save_checkpoint(tmp, tag="mid")
    losses += _steps(engine, batches[SAVE_AT:])
    out["mics"] = {
        "losses": losses,
        "weights": _weights(model),
        "elems": _state_elems(engine),
        "units": len(engine.zero.units),
        "norm0": norm0,
        "first_chunk": engine.zero.masters[0].detach().reshape(-1)[:4].clone(),
    }
    engine, model = _engine(2, offload=True)
    out["mics_offload"] = {"losses": _steps(engine, batches), "weights": _weights(model)}
    for name, mics in (("resume_mics", 2), ("resume_plain", 0)):
        engine, model = _engine(mics)
        engine.load_checkpoint(tmp, tag="mid")
        out[name] = {"losses": _steps(engine, batches[SAVE_AT:]), "weights": _weights(model)}
    engine, _ = _engine(0)
    _steps(engine, batches[:1])
    out["plain_elems"] = _state_elems(engine)
    return out


def first_grad_norm() -> float:
    """The first global batch's gradient norm (before clipping) in one plain process."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    (ids,) = _batches()[0]
    for chunk in ids.split(MICRO):
        (model(chunk, chunk) / (WORLD * GAS)).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def reference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    losses = reference_train(
        model,
        torch.optim.AdamW(model.parameters(), **ADAMW),
        _batches(),
        world_size=WORLD,
        grad_accum=GAS,
        loss_fn=lambda m, ids: m(ids, ids),
        clip=CLIP,
    )
    return model, losses


def _close(got: dict, model, what: str):
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=0, msg=f"{what}: {key}")


@pytest.mark.timeout(300)
def test_mics_trains_like_plain_pytorch_with_states_split_over_the_shard_group(tmp_path):
    results = run_distributed(_runs, WORLD, str(tmp_path), timeout=260)
    model, ref = reference()
    total = sum(p.numel() for p in model.parameters())
    for name, want in (
        ("mics", ref),
        ("mics_offload", ref),
        ("resume_mics", ref[SAVE_AT:]),
        ("resume_plain", ref[SAVE_AT:]),
    ):
        for rank, r in enumerate(results):  # (losses averaged over the ranks)
            assert max(abs(a - b) for a, b in zip(r[name]["losses"], want)) <= TOL, (name, r[name]["losses"], want)
            _close(r[name]["weights"], model, f"rank {rank} {name}")
    norm0 = first_grad_norm()  # (Adam with clipping is blind to a gradient scaled by 2; the norm is not)
    for rank, r in enumerate(results):
        assert abs(r["mics"]["norm0"] - norm0) <= 1e-5 * norm0, (rank, r["mics"]["norm0"], norm0)
        units = r["mics"]["units"]
        assert total / 2 <= r["mics"]["elems"] <= total / 2 + units * 64, (rank, r["mics"]["elems"], total)
        assert r["plain_elems"] <= total / 4 + units * 64, (rank, r["plain_elems"], total)
    # ranks 0 and 2 (index 0 of each shard group) hold the same chunk; ranks 0 and 1 different ones
    assert torch.equal(results[0]["mics"]["first_chunk"], results[2]["mics"]["first_chunk"])
    assert not torch.equal(results[0]["mics"]["first_chunk"], results[1]["mics"]["first_chunk"])
