"""Reshard on load: a checkpoint saved at world size A and ZeRO stage s loads at world size B and stage t,
optimizer states included, and training continues exactly as a single-process PyTorch run that
started from the consolidated weights and optimizer state.

One chain of jobs covers the acceptance list: 2 ranks at stage 0 -> 4 ranks at stage 2 (2 -> 4 ranks,
stage 0 -> 2) -> 2 ranks at stage 3 (4 -> 2 ranks, stage 2 -> 3) -> 2 ranks at stage 1 (stage 3 -> 1). Stage 1 -> 2
at another world size
is the same path as 2 -> 1 (stages 1 and 2 share one partition layout); at the same world size it is
a same-layout load (tests/unit/test_checkpoint_engine.py).
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_resume import GAS, build_model, make_engine, module_state, param_groups, zero_config
from test_zero_parity import SCHED, global_batches

from harness import reference_train, run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zerospeed.checkpoint.consolidate import resolve_checkpoint
from zerospeed.checkpoint.naming import MODEL_STATES
from zerospeed.checkpoint.universal import load_universal
from zerospeed.optim import build_lr_scheduler

STEPS = 2  # optimizer steps per hop


def _hop(stage: int, load_dir: str | None, save_dir: str, offset: int) -> dict:
    """Load (unless first), train STEPS steps on global batches [offset, offset + STEPS), save."""
    world, rank = comm.get_world_size(), comm.get_rank()
    engine, _ = make_engine(zero_config(stage), seed=1)
    loaded = None
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
        loaded = module_state(engine)
    losses = []
    for batch in global_batches(world, offset + STEPS)[offset:]:
        total = 0.0
        for x, y in split_global_batch(batch, world, GAS, rank):
            loss = engine(x, y)
            total += loss.item()
            engine.backward(loss)
            engine.step()
        t = torch.tensor([total / GAS])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    engine.save_checkpoint(save_dir)
    return {"loaded": loaded, "losses": losses, "steps": engine.global_steps, "state": module_state(engine)}


@pytest.fixture(autouse=True)
def one_thread():
    # Two intra-op threads on two busy cores spin against the spawned ranks: 20x slower here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_from_checkpoint(ckpt_dir: str, world: int, offset: int):
    """Plain PyTorch continuing from the consolidated weights, optimizer state and scheduler of a checkpoint."""
    model = build_model(seed=2)
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(ckpt_dir), strict=True)
    tag_dir, manifest = resolve_checkpoint(ckpt_dir)
    saved = torch.load(tag_dir / MODEL_STATES, weights_only=False)
    uni = load_universal(tag_dir, manifest)
    opt = torch.optim.AdamW(param_groups(model), lr=1.0)
    sched = build_lr_scheduler(SCHED["type"], dict(SCHED["params"]), opt)  # writes its initial lr: build first
    sched.load_state_dict(saved["lr_scheduler"])
    for group, hparams in zip(opt.param_groups, saved["optimizer_param_groups"]):
        group.update(hparams)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            full = uni.tensors[names[id(p)]]
            opt.state[p] = {
                **uni.scalars[names[id(p)]],
                "exp_avg": full["exp_avg"].clone(),
                "exp_avg_sq": full["exp_avg_sq"].clone(),
            }
    batches = global_batches(world, offset + STEPS)[offset:]
    losses = reference_train(model, opt, batches, world_size=world, grad_accum=GAS, scheduler=sched, clip=1.0)
    return losses, model.state_dict()


@pytest.mark.timeout(240)
def test_checkpoints_reshard_across_world_sizes_and_stages(tmp_path):
    hops = [(2, 0), (4, 2), (2, 3), (2, 1)]  # (world size, stage)
    previous = None
    for i, (world, stage) in enumerate(hops):
        where = f"hop {i}: {hops[i - 1] if i else None} -> (world {world}, stage {stage})"
        save_dir = str(tmp_path / f"hop{i}")
        results = run_distributed(_hop, world, stage, previous, save_dir, i * STEPS, timeout=100)
        assert results[0]["steps"] == (i + 1) * STEPS, where
        if previous is not None:
            consolidated = get_fp32_state_dict_from_zero_checkpoint(previous)
            ref_losses, ref_state = reference_from_checkpoint(previous, world, i * STEPS)
            for r in results:
                # right after the load every rank holds exactly the consolidated weights
                for k, v in consolidated.items():
                    assert torch.equal(r["loaded"][k], v), f"{where}: {k} after load: {r['loaded'][k]} vs {v}"
                diffs = [abs(a - b) for a, b in zip(r["losses"], ref_losses)]
                assert len(diffs) == STEPS and max(diffs) <= 1e-5, (where, diffs)
                for k, v in ref_state.items():
                    if k == "seen_batches":
                        continue  # counts forwards: the reference runs every rank's micro-batches itself
                    torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-5, msg=f"{where}: {k}")
        previous = save_dir
