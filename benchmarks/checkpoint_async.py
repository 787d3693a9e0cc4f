"""How long a checkpoint save blocks training: the synchronous save against the asynchronous one
(checkpoint/async_writer.py), on the 124M GPT-2 (transformers' GPT2LMHeadModel, n_layer 12, n_embd 768) at
2 ranks, fp32, AdamW.

    python benchmarks/checkpoint_async.py [--stage 2 --saves 3 --seq 64 --micro 1 --dir /tmp]

Per save, on the slowest rank:
- sync: `engine.save_checkpoint` of the synchronous writer (the whole write: serialise, fsync, hash,
  manifest, `latest`) — training is blocked all that time;
- async blocked: `engine.save_checkpoint` of the asynchronous writer (`checkpoint.writer.decoupled`), i.e.
  the host snapshot, plus the time the commit takes in the optimizer step that commits it (manifest,
  rename, `latest`, the all-gathers) — the stall the issue asks about;
- async interference: how much longer the training steps that ran during the background write took than
  steps without one (the writer thread shares the CPU with training: on this 2-core machine both ranks'
  writers compete with both ranks' training);
- steps until commit: optimizer steps trained while the save was in flight.
The same process, model and data run both modes, one after the other.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch


def _engine(stage: int, micro: int, asynchronous: bool):
    import transformers

    import zerospeed

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if asynchronous:
        ds["checkpoint"] = {"writer": {"decoupled": True}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def _step(engine, batch) -> float:
    start = time.perf_counter()
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


def _run(args) -> dict:
    from zerospeed import comm
    from zerospeed.runtime import checkpoint_saves

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(comm.get_rank())
    batch = torch.randint(0, 50257, (args.micro, args.seq), generator=gen)
    root = os.path.join(args.dir, "ckpt")
    out: dict = {"sync": [], "snapshot": [], "commit": [], "interference": [], "steps_in_flight": [], "base_step": 0.0}

    engine = _engine(args.stage, args.micro, asynchronous=False)
    for _ in range(2):
        _step(engine, batch)
    base = statistics.median(_step(engine, batch) for _ in range(3))
    out["base_step"] = base
    for i in range(args.saves):
        comm.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(root, tag=f"sync{i}")
        out["sync"].append(time.perf_counter() - start)
        _step(engine, batch)
    del engine

    engine = _engine(args.stage, args.micro, asynchronous=True)
    commit_times: list[float] = []
    real_after_step = checkpoint_saves.CheckpointCommitHook.after_step

    def timed_after_step(hook, eng):
        start = time.perf_counter()
        was = hook.saves.in_flight()
        real_after_step(hook, eng)
        if was and not hook.saves.in_flight():  # this step committed the save
            commit_times.append(time.perf_counter() - start)

    checkpoint_saves.CheckpointCommitHook.after_step = timed_after_step
    for _ in range(2):
        _step(engine, batch)
    for i in range(args.saves):
        comm.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(root, tag=f"async{i}")
        out["snapshot"].append(time.perf_counter() - start)
        saves = engine._checkpoint_saves
        steps = []
        while saves.in_flight() and len(steps) < 200:
            steps.append(_step(engine, batch))
        out["steps_in_flight"].append(len(steps))
        out["interference"].append(sum(steps) - len(steps) * base)
        out["commit"].append(commit_times[-1] if commit_times else float("nan"))
    engine.destroy()
    checkpoint_saves.CheckpointCommitHook.after_step = real_after_step
    out["bytes"] = sum(
        os.path.getsize(os.path.join(root, "async0", f)) for f in os.listdir(os.path.join(root, "async0"))
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    args = parser.parse_args()
    from harness import run_distributed

    args.dir = tempfile.mkdtemp(prefix="zs-ckpt-bench-", dir=args.dir)
    try:
        ranks = run_distributed(_run, 2, args, timeout=3600)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)

    def slowest(key):
        return [max(r[key][i] for r in ranks) for i in range(args.saves)]

    sync, snap, commit = slowest("sync"), slowest("snapshot"), slowest("commit")
    blocked = [s + c for s, c in zip(snap, commit)]
    inter, inflight = slowest("interference"), slowest("steps_in_flight")
    print(f"# checkpoint stall, 124M GPT-2, 2 ranks, ZeRO-{args.stage}, fp32 AdamW, seq {args.seq} x {args.micro}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"# files of one tag: {ranks[0]['bytes'] / 1e6:.0f} MB on rank 0's node (both ranks' files)")
    print(f"# training step without a save: {max(r['base_step'] for r in ranks):.3f} s (slowest rank)")
    print("| save | sync s | async: snapshot s | commit s | blocked s | blocked / sync | interference s | steps |")
    print("|---|---|---|---|---|---|---|---|")
    for i in range(args.saves):
        print(
            f"| {i} | {sync[i]:.3f} | {snap[i]:.3f} | {commit[i]:.3f} | {blocked[i]:.3f} | "
            f"{blocked[i] / sync[i]:.1%} | {inter[i]:.3f} | {inflight[i]} |"
        )
    ms, mb = statistics.median(sync), statistics.median(blocked)
    print(f"median: sync {ms:.3f} s, async blocked {mb:.3f} s = {mb / ms:.1%} of the synchronous save")


if __name__ == "__main__":
    main()
