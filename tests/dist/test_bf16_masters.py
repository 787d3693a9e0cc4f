"""`bf16.bf16_master_weights_and_grads` + `bf16_optimizer_states` (Note [bf16 masters] in
precision/policy.py) at ZeRO 1, 2 and 3 on 2 ranks, against one plain PyTorch process.

The reference is a bf16 model trained by plain `torch.optim.AdamW` on its bf16 parameters (so its
states are bf16 too). Each rank's micro-batch gradient is computed on that model and the two are
averaged in bf16, as the collective does. With no fp32 anywhere in the update, the engine must match it
bit for bit: losses and final weights equal over 6 steps. Standard bf16 training (fp32 masters) differs
from that reference, and the test checks that it does, so the comparison can fail.

Memory: a census of live tensors (gc, storages deduplicated) after a step at ZeRO-2. Standard bf16
holds fp32 masters (4N/W), fp32 gradient shards (4N/W) and fp32 moments (8N/W); bf16 masters are the
bf16 weights' own partitions (0) and hold bf16 gradient shards (2N/W) and bf16 moments (4N/W). So the
census falls by 10N/W bytes (N elements, W ranks; checked within 5%). The masters and optimizer states
are bf16 at every stage, and the masters share the weights' storage at stages 1-2.

Checkpoints: saved after 3 steps, resumed at ZeRO-2 and (resharded) ZeRO-1 with bf16 masters the
last 3 losses are the uninterrupted run's exactly; standard bf16 (fp32 masters) loads it too (within
1e-2: its updates are no longer rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import single_threaded
from zoo.models import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
MICRO, STEPS, WORLD = 2, 6, 2
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def _batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, CFG["vocab_size"], (WORLD * MICRO, CFG["block_size"]), generator=g) for _ in range(STEPS)]


def _model(tied: bool):
    """The test GPT; at stage 3 untied: a tied weight's two uses reduce apart there, so its bf16
    gradient rounds once per use, where autograd's sum rounds once (one bf16 rounding apart)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model


def _engine(stage: int, masters: bool):
    import zerospeed

    model = _model(tied=stage < 3)
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": masters, "bf16_optimizer_states": masters}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "bf16": bf16,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    return engine, model


def _step(engine, batch) -> float:
    from zerospeed import comm

    rank = comm.get_rank()
    ids = batch[rank * MICRO : (rank + 1) * MICRO]
    loss = engine(ids, ids)
    engine.backward(loss)
    engine.step()
    return loss.float().item()


def _train(stage: int, masters: bool):
    import zerospeed
    from harness.census import live_tensor_bytes

    base = live_tensor_bytes()  # (what earlier runs of this process left, their results)
    engine, model = _engine(stage, masters)
    losses, census = [], None
    for step, batch in enumerate(_batches()):
        losses.append(_step(engine, batch))
        if step == 0:
            census = live_tensor_bytes() - base
    states = [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    masters_t = [m for g in engine.optimizer.param_groups for m in g["params"]]
    weights_storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "weights": weights,
        "census": census,
        "state_dtypes": {v.dtype for v in states},
        "master_dtypes": {m.dtype for m in masters_t},
        "aliased": all(m.untyped_storage().data_ptr() in weights_storages for m in masters_t),
    }


RUNS = [(1, True), (2, True), (3, True), (2, False)]


def _resume(tmp: str) -> dict:
    """Save after 3 steps of bf16 masters at ZeRO-2; the last 3 steps from a fresh engine loading it: at
    ZeRO-2 and ZeRO-1 with bf16 masters (states cast to the masters' dtype), and standard bf16."""
    batches = _batches()
    engine, _ = _engine(2, True)
    for batch in batches[:3]:
        _step(engine, batch)
    engine.save_checkpoint(tmp, tag="mid")
    out = {"continued": [_step(engine, b) for b in batches[3:]]}
    for name, stage, masters in (("zero2", 2, True), ("zero1", 1, True), ("standard", 2, False)):
        engine, _ = _engine(stage, masters)
        engine.load_checkpoint(tmp, tag="mid")
        out[name] = [_step(engine, b) for b in batches[3:]]
    return out


def _runs(tmp: str):
    return {**{run: _train(*run) for run in RUNS}, "resume": _resume(tmp)}


def reference(tied: bool):
    """A bf16 model, plain AdamW on bf16 parameters; gradients averaged over the ranks in bf16."""
    model = _model(tied).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for batch in _batches():
        per_rank, step_losses = [], []
        for r in range(WORLD):
            opt.zero_grad(set_to_none=True)
            ids = batch[r * MICRO : (r + 1) * MICRO]
            loss = model(ids, ids)
            loss.backward()
            step_losses.append(loss.float().item())
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *per_rank):
            p.grad = (g0 + g1) * 0.5  # bf16 sum (one rounding), halved exactly
        opt.step()
        losses.append(step_losses)
    return model, losses


@pytest.mark.timeout(240)
def test_bf16_masters_and_states_train_like_plain_bf16_adamw_and_drop_the_fp32_copies(tmp_path):
    results = run_distributed(_runs, WORLD, str(tmp_path), timeout=200)
    with single_threaded():  # as the ranks compute (bf16 reductions round by thread split)
        refs = {tied: reference(tied) for tied in (True, False)}
    model = refs[True][0]
    n = sum(p.numel() for p in model.parameters())
    for rank, res in enumerate(results):
        for run in RUNS[:3]:
            got = res[run]
            model, losses = refs[run[0] < 3]
            assert got["state_dtypes"] == {torch.bfloat16} and got["master_dtypes"] == {torch.bfloat16}, run
            assert got["losses"] == [step[rank] for step in losses], (run, got["losses"])
            for key, value in model.state_dict().items():
                assert torch.equal(got["weights"][key], value), (run, key, (got["weights"][key] - value).abs().max())
            if run[0] < 3:  # stage 3's weights live gathered only; its shards are the masters
                assert got["aliased"], run
        model = refs[True][0]
        standard = res[(2, False)]
        assert standard["master_dtypes"] == {torch.float32}
        assert any(not torch.equal(standard["weights"][k], v) for k, v in model.state_dict().items())
        resume = res["resume"]
        assert resume["zero2"] == resume["zero1"] == resume["continued"], resume
        assert max(abs(a - b) for a, b in zip(resume["standard"], resume["continued"])) <= 1e-2, resume
        saved = standard["census"] - res[(2, True)]["census"]
        want = 10 * n / WORLD
        assert abs(saved - want) <= 0.05 * want, (rank, saved, want)
