"""What `checkpoint.deepspeed_layout` costs at ZeRO 0-3: bytes on disk and seconds per save, with and without it.

    .venv/bin/python benchmarks/deepspeed_layout_size.py [--hidden 1024] [--layers 4] [--saves 3] [--stage 3]

2 gloo ranks train an MLP of `layers` square Linear layers (AdamW, fp32) for one step, then save `saves` times
with the key off and on. The table gives each tag's files and bytes, and the median seconds of a save: with the
key a rank file holds DeepSpeed's `optimizer_state_dict` and zerospeed's entries over the same storages, so it
should be the size of the plain rank file (not twice it), plus (ZeRO 3) DeepSpeed's small per-rank model states.
At ZeRO 0 the optimizer state and zerospeed's entries move into the model states (Note [as-saved ZeRO 0]): the
tag holds the weights once instead of twice (model states and rank 0's file).
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _run(rank, world, port, hidden, layers, saves, folder, out, stage=3):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import zerospeed

    zerospeed.init_distributed(dist_backend="gloo")
    results = {}
    for as_saved in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "checkpoint": {"deepspeed_layout": as_saved},
        }
        engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        engine.backward(engine(torch.randn(2, hidden)).square().mean())
        engine.step()
        seconds = []
        tag_root = os.path.join(folder, "on" if as_saved else "off")
        for _ in range(saves):
            zerospeed.comm.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(tag_root, tag="t")
            seconds.append(time.perf_counter() - start)
        tag = os.path.join(tag_root, "t")
        results[as_saved] = (
            {f: os.path.getsize(os.path.join(tag, f)) for f in sorted(os.listdir(tag))},
            statistics.median(seconds),
        )
    if rank == 0:
        torch.save(results, out)
    zerospeed.comm.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--port", type=int, default=29811)
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(_run, args=(2, args.port, args.hidden, args.layers, args.saves, tmp, out, args.stage), nprocs=2)
        results = torch.load(out)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(
        f"torch {torch.__version__}; 2 gloo ranks; ZeRO {args.stage}; {params} fp32 parameters, AdamW "
        "(3 x 4 bytes each in state)\n"
    )
    print("| file | key off (bytes) | key on (bytes) |")
    print("|---|---:|---:|")
    off, on = results[False][0], results[True][0]
    for name in sorted(set(off) | set(on)):
        print(f"| {name} | {off.get(name, '')} | {on.get(name, '')} |")
    print(f"| all | {sum(off.values())} | {sum(on.values())} |")
    print(f"\nmedian save: key off {results[False][1]:.3f} s, key on {results[True][1]:.3f} s")


if __name__ == "__main__":
    main()
