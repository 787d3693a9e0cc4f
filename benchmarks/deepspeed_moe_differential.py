"""The real DeepSpeed resumes zerospeed's MoE checkpoints: export differential (issue 46).

    .venv/bin/python benchmarks/deepspeed_moe_differential.py --deepspeed-python /work/dsvenv/bin/python

For each PAIR `S:E:T:F` of `--pairs`: zerospeed trains the MoE fixture model (tests/fixtures/deepspeed_0.19.8/
make_moe.py: one `MoE` layer of 4 experts, top-1, AdamW, WarmupLR, 2 gloo ranks, 2 accumulation steps) at
ZeRO S with expert-parallel size E for 3 steps, saves, and goes on for 3 more; `zerospeed-ckpt export --to
deepspeed --stage T --dp 2 --ep F` writes the step-3 tag in DeepSpeed's MoE layout (expert files, and the
expp_rank_* optimizer files at ZeRO 0); the real DeepSpeed builds the same model with its own `MoE` at ep F
and ZeRO T, `load_checkpoint`s the export and trains the same 3 steps. The table gives the largest |Δ| between
the two continuations' losses, and between DeepSpeed's parameters right after the load (every rank's, experts
under global names) and zerospeed's after step 3. Gradient clipping is DeepSpeed's default 1.0, or 0 when
either side runs ZeRO 0 (DeepSpeed's ZeRO-0 engine clips MoE models by the mean of the ranks' own norms:
make_moe.clipping).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "deepspeed_0.19.8"))
import make  # noqa: E402
import make_moe  # noqa: E402

PAIRS = ["0:2:0:2", "2:2:2:2", "1:2:2:2", "2:2:1:1", "3:1:2:2", "2:1:0:2"]


def _clip(zs_stage: int, ds_stage: int) -> float:
    return 0.0 if 0 in (zs_stage, ds_stage) else 1.0


def _train(eng, rank, world, steps):
    return [make.train_step(eng, make_moe.step_loss(eng, x, y), rank, world) for x, y in steps]


def _every_rank(m, ep_rank, ep, world):
    every = [None] * world
    torch.distributed.all_gather_object(every, make_moe.global_weights(m, ep_rank, ep))
    return {k: v.tolist() for w in every for k, v in w.items()}


def zerospeed_run(rank, world, stage, ep, clip, folder, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import zerospeed
    from zerospeed import comm
    from zerospeed.moe.layer import MoE
    from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    zerospeed.init_distributed(dist_backend="gloo")
    m = make_moe.moe_model(MoE, ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()), "name": "params"})
    eng, *_ = zerospeed.initialize(model=m, model_parameters=groups, config=make_moe.config(stage, clip))
    batches = make_moe.moe_batches()
    _train(eng, rank, world, batches[:3])
    eng.save_checkpoint(folder, tag="step3")
    with zerospeed.zero.GatheredParameters(list(m.parameters())):
        weights = _every_rank(m, comm.get_rank(m.moe.deepspeed_moe.ep_group), ep, world)
    losses = _train(eng, rank, world, batches[3:])
    if rank == 0:
        json.dump({"losses": losses, "weights": weights}, open(os.path.join(folder, "zerospeed.json"), "w"))


def deepspeed_run(rank, world, stage, ep, clip, folder, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    m = make_moe.moe_model(MoE, ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()), "name": "params"})
    eng, *_ = deepspeed.initialize(model=m, model_parameters=groups, config=make_moe.config(stage, clip))
    eng.load_checkpoint(os.path.join(folder, "export"))
    weights = _every_rank(m, rank % ep, ep, world)
    losses = _train(eng, rank, world, make_moe.moe_batches()[3:])
    if rank == 0:
        json.dump({"losses": losses, "weights": weights}, open(os.path.join(folder, "deepspeed.json"), "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _pair(python: str, pair: str, port: int, script: str | None = None) -> tuple | str:
    """One PAIR: the zerospeed phase, the export, the DeepSpeed phase of `script` (this file by default; the AutoEP
    differential shares this driver). Returns (largest |Δ| of the losses, of the weights, DeepSpeed's losses, |Δ|
    of each step's loss), or what failed."""
    s, e, t, f = (int(v) for v in pair.split(":"))
    clip = _clip(s, t)
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
        me = script or os.path.abspath(__file__)
        steps = [
            [sys.executable, me, "--phase", "zerospeed", f"{s}:{e}", str(clip), folder, str(port)],
            [sys.executable, "-m", "zerospeed.checkpoint.cli", "export", folder, os.path.join(folder, "export")]
            + ["--to", "deepspeed", "--stage", str(t), "--dp", "2", "--ep", str(f)],
            [python, me, "--phase", "deepspeed", f"{t}:{f}", str(clip), folder, str(port + 1)],
        ]
        for argv in steps:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
            if proc.returncode != 0 and not os.path.exists(os.path.join(folder, "deepspeed.json")):
                return f"{os.path.basename(argv[0])} {argv[2:4]} failed: {proc.stderr.strip().splitlines()[-1:]}"
        zs = json.load(open(os.path.join(folder, "zerospeed.json")))
        ds = json.load(open(os.path.join(folder, "deepspeed.json")))
    loss = max(abs(a - b) for a, b in zip(zs["losses"], ds["losses"]))
    assert set(zs["weights"]) == set(ds["weights"]), (sorted(zs["weights"]), sorted(ds["weights"]))
    weight = max(
        float((torch.tensor(zs["weights"][k]) - torch.tensor(v)).abs().max()) for k, v in ds["weights"].items()
    )
    return loss, weight, ds["losses"], [abs(a - b) for a, b in zip(zs["losses"], ds["losses"])]


def parser(doc: str, pairs: list[str], port: int) -> argparse.ArgumentParser:
    """The command line of an export differential (this one's, the AutoEP one's)."""
    out = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--deepspeed-python", help="a Python with the real DeepSpeed 0.19.8")
    out.add_argument("--pairs", nargs="*", default=pairs, help="S:E:T:F (zerospeed ZeRO:ep, DeepSpeed ZeRO:ep)")
    out.add_argument("--port", type=int, default=port)
    out.add_argument("--phase", nargs=5, metavar=("WHO", "STAGE:EP", "CLIP", "FOLDER", "PORT"))
    return out


def drive(args, zerospeed_phase, deepspeed_phase, script: str) -> None:
    """Run one `--phase` (2 spawned ranks of `zerospeed_phase` or `deepspeed_phase`), or every pair of `--pairs`
    through `script`'s phases, printing the table."""
    if args.phase:
        who, stage_ep, clip, folder, port = args.phase
        stage, ep = (int(v) for v in stage_ep.split(":"))
        fn = zerospeed_phase if who == "zerospeed" else deepspeed_phase
        mp.spawn(fn, args=(2, stage, ep, float(clip), folder, int(port)), nprocs=2)
        return
    print("| zerospeed ZeRO, ep | DeepSpeed loads at ZeRO, ep | max abs diff of losses, steps 4-6 | of weights |")
    print("|---|---|---:|---:|")
    for i, pair in enumerate(args.pairs):
        got = _pair(args.deepspeed_python, pair, args.port + 2 * i, script=os.path.abspath(script))
        s, e, t, f = pair.split(":")
        if isinstance(got, str):
            print(f"| {s}, {e} | {t}, {f} | {got} | |")
        else:
            steps = ", ".join(f"{d:.2g}" for d in got[3])
            print(f"| {s}, {e} | {t}, {f} | {got[0]:.3g} | {got[1]:.3g} |  (per step {steps}; DeepSpeed's {got[2]})")
        sys.stdout.flush()


def main() -> None:
    drive(parser(__doc__, PAIRS, 29671).parse_args(), zerospeed_run, deepspeed_run, __file__)


if __name__ == "__main__":
    main()
