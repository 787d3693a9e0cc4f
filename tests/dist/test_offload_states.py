"""DeepSpeed's `engine.offload_states()` / `reload_states()` (Note [offloaded states] in
offload/states.py), at ZeRO 0-3 on 2 ranks, against one plain PyTorch process.

Each engine trains one step, offloads the optimizer states alone, then every state, and reloads each
time; then trains two more steps. Checked:
- what is offloaded is released: every storage behind the user-visible handles of the selected kinds
  (the optimizer's state tensors, the module's parameters; at stage 3 the parameters persistent units
  keep) has zero bytes, the kinds not selected keep theirs, `get_state_devices` names the host;
- forward, backward, step and checkpoints are refused until `reload_states()`, naming it;
- reloading restores every byte (the same tensors, equal to snapshots taken before), and the run's losses
  and final weights are plain PyTorch's (AdamW over the same global batches) within 1e-6 — an offload
  that lost or misplaced any moment or weight would fail it.
What a CPU machine cannot show: the host is the device here, so the host copies are not pinned and no
device memory falls; tests/gpu/test_gpu_offload_states.py checks that on a GPU.
"""

from __future__ import annotations

import pytest
import torch

# the model, batches and optimizer of the manual-backward test: GPT without biases, 2 accumulation steps
from test_manual_backward import ADAMW, CFG, GAS, MICRO, STEPS, TOL, WORLD, _batches, reference  # noqa: E402

from harness import run_distributed
from harness.reference import split_global_batch
from zoo.models import GPT, GPTConfig


def _storages(tensors) -> dict:
    """The distinct storages behind `tensors`, by identity."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        out.setdefault(s._cdata, s)
    return out


def _nbytes(storages: dict) -> int:
    return sum(s.nbytes() for s in storages.values())


def _snapshot(storages: dict) -> dict:
    return {k: torch.empty(0, dtype=torch.uint8).set_(s).clone() for k, s in storages.items()}


def _same(storages: dict, snap: dict) -> bool:
    return all(torch.equal(torch.empty(0, dtype=torch.uint8).set_(storages[k]), v) for k, v in snap.items())


def _refusals(engine, ids, tmp: str) -> list[str]:
    out = []
    for call in (lambda: engine(ids, ids), lambda: engine.step(), lambda: engine.save_checkpoint(tmp)):
        try:
            call()
            out.append("")
        except RuntimeError as e:
            out.append(str(e))
    return out


def _train(stage, tmp: str):
    """`stage`: a ZeRO stage, or "2-bf16" (bf16 weights, fp32 masters: the two are separate storages)."""
    import zerospeed
    from zerospeed import comm
    from zerospeed.offload.states import OffloadStateTypeEnum as S
    from zerospeed.offload.states import get_state_devices

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    bf16 = stage == "2-bf16"
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 2 if bf16 else stage, "stage3_param_persistence_threshold": 64},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    losses, checks = [], {}
    for step, batch in enumerate(_batches()):
        total = 0.0
        for (ids,) in split_global_batch(batch, WORLD, GAS, comm.get_rank()):
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / GAS)
        if step == 0:
            opt = _storages(
                v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1
            )
            params = _storages(p for p in model.parameters() if p.numel())  # stage 3: persistent ones only
            before = {"opt": _nbytes(opt), "params": _nbytes(params)}
            snap_opt, snap_params = _snapshot(opt), _snapshot(params)
            engine.offload_states(include=[S.optim_states])
            checks["opt_only"] = (_nbytes(opt), _nbytes(params), get_state_devices(engine, S.optim_states))
            checks["opt_only_refused"] = _refusals(engine, ids, tmp)
            engine.reload_states()
            checks["opt_only_restored"] = _same(opt, snap_opt) and _same(params, snap_params)
            if bf16:  # the masters alone leave the bf16 weights; the weights alone leave the moments
                engine.offload_states(include=[S.hp_params])
                checks["hp_only"] = (_nbytes(opt), _nbytes(params))
                engine.reload_states()
                engine.offload_states(include=[S.lp_params])
                checks["lp_only"] = (_nbytes(opt), _nbytes(params))
                engine.reload_states()
            engine.offload_states()
            checks["all"] = (_nbytes(opt), _nbytes(params))
            engine.reload_states()
            checks["all_restored"] = _same(opt, snap_opt) and _same(params, snap_params)
            checks["before"] = before
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "checks": checks}


def _runs(stages, tmp):
    return {stage: _train(stage, tmp) for stage in stages}


@pytest.mark.timeout(240)
def test_offload_then_reload_states_frees_them_and_trains_like_plain_pytorch(tmp_path):
    stages = (0, 1, 2, 3, "2-bf16")
    results = run_distributed(_runs, WORLD, stages, str(tmp_path), timeout=200)
    model, ref = reference()
    for stage in stages:
        got = [r[stage] for r in results]
        mean = [sum(g["losses"][i] for g in got) / WORLD for i in range(STEPS)]
        if stage != "2-bf16":  # (bf16 has no fp32 reference to meet within 1e-6)
            assert max(abs(a - b) for a, b in zip(mean, ref)) <= TOL, (stage, mean, ref)
        for rank, g in enumerate(got):
            c, where = g["checks"], f"stage {stage} rank {rank}"
            assert c["before"]["opt"] > 0 and c["before"]["params"] > 0, where
            # the optimizer states alone: released, on the host, the weights untouched
            assert c["opt_only"] == (0, c["before"]["params"], {torch.device("cpu")}), (where, c)
            assert all("reload_states()" in msg for msg in c["opt_only_refused"]), (where, c["opt_only_refused"])
            assert c["all"] == (0, 0), (where, c["all"])
            assert c["opt_only_restored"] and c["all_restored"], where
            if stage == "2-bf16":
                assert c["hp_only"] == (c["before"]["opt"], c["before"]["params"]), (where, c)
                assert c["lp_only"] == (c["before"]["opt"], 0), (where, c)
                continue
            for key, value in model.state_dict().items():
                torch.testing.assert_close(g["weights"][key], value, atol=TOL, rtol=0, msg=f"{where} {key}")
