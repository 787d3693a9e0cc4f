"""The real DeepSpeed resumes zerospeed's AutoEP checkpoints: export differential (issue 46).

    .venv/bin/python benchmarks/deepspeed_autoep_differential.py --deepspeed-python /work/dsvenv/bin/python

For each PAIR `S:E:T:F` of `--pairs`: zerospeed trains the AutoEP fixture model (tests/fixtures/deepspeed_0.19.8/
make_autoep.py: a tiny transformers Mixtral, 4 experts, top-2, under `"expert_parallel": {"enabled": true,
"autoep_size": E, "preset_model": "mixtral"}`, AdamW, WarmupLR, 2 gloo ranks, 2 accumulation steps) at ZeRO S for 3
steps, saves, and goes on for 3 more; `zerospeed-ckpt export --to deepspeed --stage T --dp 2 --ep F` writes the
step-3 tag in DeepSpeed's AutoEP layout (checkpoint/deepspeed_autoep_export.py); the real DeepSpeed builds the same
model under its AutoEP at autoep_size F and ZeRO T, `load_checkpoint`s the export and trains the same 3 steps. The
table gives the largest |Δ| between the two continuations' losses, and between DeepSpeed's parameters right after
the load (every rank's experts stacked back to [E, ...] in ep-rank order, renamed to the transformers model's names
from DeepSpeed's own account, `_transformers_names`) and zerospeed's own consolidation of the step-3 tag.
Model, batches, config and the DeepSpeed-side transformers patch come from make_autoep.py (the MoE differential's
pattern: benchmarks/deepspeed_moe_differential.py, whose `_pair` driver this script shares).
"""

import argparse
import json
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "deepspeed_0.19.8"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import deepspeed_moe_differential as moe_diff  # noqa: E402
import make  # noqa: E402
import make_autoep  # noqa: E402

PAIRS = ["2:2:2:2", "3:2:3:2", "1:1:2:2", "2:2:3:1", "3:1:1:2", "2:2:0:2", "0:2:3:2"]


def _config(stage: int, ep: int) -> dict:
    return make_autoep.config(stage, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": "mixtral"})


def _train(eng, rank, world, batches):
    step = lambda ids: lambda lo: eng(input_ids=ids[lo : lo + 2], labels=ids[lo : lo + 2]).loss  # noqa: E731
    return [make.train_step(eng, step(ids), rank, world) for ids in batches]


def _env(rank, world, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)


def zerospeed_run(rank, world, stage, ep, clip, folder, port):
    del clip
    _env(rank, world, port)
    import zerospeed
    from zerospeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

    zerospeed.init_distributed(dist_backend="gloo")
    m = make_autoep.mixtral()
    eng, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, ep))
    batches = make_autoep.batches(world)
    _train(eng, rank, world, batches[:3])
    eng.save_checkpoint(folder, tag="step3")
    losses = _train(eng, rank, world, batches[3:])
    if rank == 0:  # zerospeed's consolidation of the step-3 tag (the transformers model's names)
        weights = {n: v.tolist() for n, v in get_fp32_state_dict_from_zero_checkpoint(folder, tag="step3").items()}
        json.dump({"losses": losses, "weights": weights}, open(os.path.join(folder, "zerospeed.json"), "w"))


def _transformers_names(weights: dict) -> dict:
    """DeepSpeed's AutoEP parameters under the transformers model's names, written here from DeepSpeed's own account
    (moe/ep_repack.py: w1 = the gate rows, w3 = the up rows of gate_up_proj [E, 2I, H], w2 = down_proj; the router
    `router.gate` is the block's `gate`) rather than with zerospeed's table, so the weight column checks that too."""
    out = {}
    for name, value in weights.items():
        if name.endswith(".experts.w1"):
            out[name[: -len("w1")] + "gate_up_proj"] = torch.cat([value, weights[name[: -len("w1")] + "w3"]], dim=1)
        elif name.endswith(".experts.w2"):
            out[name[: -len("w2")] + "down_proj"] = value
        elif not name.endswith(".experts.w3"):
            out[name.replace(".router.gate.", ".gate.")] = value
    return out


def deepspeed_run(rank, world, stage, ep, clip, folder, port):
    del clip
    deepspeed = make.start(rank, world, port)
    make_autoep._let_registry_get_take_a_default()  # (make_autoep.py: transformers 5.24 vs DeepSpeed 0.19.8)
    m = make_autoep.mixtral()
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(stage, ep))
    eng.load_checkpoint(os.path.join(folder, "export"))
    mine = {}
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
        for name, p in eng.module.named_parameters():
            mine[name] = p.detach().clone()
    every = [None] * world
    torch.distributed.all_gather_object(every, (rank % ep, mine))
    losses = _train(eng, rank, world, make_autoep.batches(world)[3:])
    if rank == 0:
        full = {}
        for name, value in every[0][1].items():
            if ".experts.w" in name:  # ep rank e's rows, from the first rank holding each ep rank
                by_ep = {e: w[name] for e, w in reversed(every)}
                value = torch.cat([by_ep[e] for e in range(ep)])
            full[name] = value
        weights = {n: v.tolist() for n, v in _transformers_names(full).items()}
        json.dump({"losses": losses, "weights": weights}, open(os.path.join(folder, "deepspeed.json"), "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", help="a Python with the real DeepSpeed 0.19.8")
    parser.add_argument("--pairs", nargs="*", default=PAIRS, help="S:E:T:F (zerospeed ZeRO:ep, DeepSpeed ZeRO:ep)")
    parser.add_argument("--port", type=int, default=29771)
    parser.add_argument("--phase", nargs=5, metavar=("WHO", "STAGE:EP", "CLIP", "FOLDER", "PORT"))
    args = parser.parse_args()
    if args.phase:
        who, stage_ep, clip, folder, port = args.phase
        stage, ep = (int(v) for v in stage_ep.split(":"))
        fn = zerospeed_run if who == "zerospeed" else deepspeed_run
        mp.spawn(fn, args=(2, stage, ep, float(clip), folder, int(port)), nprocs=2)
        return
    print("| zerospeed ZeRO, ep | DeepSpeed loads at ZeRO, ep | max abs diff of losses, steps 4-6 | of weights |")
    print("|---|---|---:|---:|")
    for i, pair in enumerate(args.pairs):
        got = moe_diff._pair(args.deepspeed_python, pair, args.port + 2 * i, script=os.path.abspath(__file__))
        s, e, t, f = pair.split(":")
        if isinstance(got, str):
            print(f"| {s}, {e} | {t}, {f} | {got} | |")
        else:
            print(f"| {s}, {e} | {t}, {f} | {got[0]:.3g} | {got[1]:.3g} |  (DeepSpeed's losses {got[2]})")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
