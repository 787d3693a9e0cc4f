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
`--bf16`: both sides train with `"bf16": {"enabled": true}` (make_autoep.py --bf16's run; ZeRO 1-3, the export
is `bf16_zero_pp_rank_*` files) and the weight column compares DeepSpeed's fp32 masters after the load
(`safe_get_full_fp32_param`) with zerospeed's consolidation: exact; the losses follow bf16 gradients that the two
libraries sum in another order (within 1e-4, docs/checkpoints.md).
Model, batches, config and the DeepSpeed-side transformers patch come from make_autoep.py (the MoE differential's
pattern: benchmarks/deepspeed_moe_differential.py, whose command line and `_pair` driver this script shares).
"""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "deepspeed_0.19.8"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import deepspeed_moe_differential as moe_diff  # noqa: E402
import make  # noqa: E402
import make_autoep  # noqa: E402

PAIRS = ["2:2:2:2", "3:2:3:2", "1:1:2:2", "2:2:3:1", "3:1:1:2", "2:2:0:2", "0:2:3:2"]
BF16_PAIRS = ["2:2:2:2", "3:2:3:2", "1:2:1:2", "2:2:3:1", "3:1:1:2", "1:1:2:2"]  # (bf16 is written at ZeRO 1-3)


BF16_ENV = "ZS_AUTOEP_DIFFERENTIAL_BF16"  # set by --bf16


def _bf16() -> bool:
    return os.environ.get(BF16_ENV) == "1"


def _config(stage: int, ep: int) -> dict:
    cfg = make_autoep.config(stage, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": "mixtral"})
    if _bf16():  # (make_autoep.py --bf16's run: gradients accumulate in bf16 on both sides, their default)
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(eng, rank, world, batches):
    return [make.train_step(eng, make_autoep.loss_of(eng, ids), rank, world) for ids in batches]


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
    if _bf16():  # the fp32 masters, DeepSpeed's own account of them (the module holds their bf16 copies)
        for name, p in eng.module.named_parameters():
            mine[name] = deepspeed.utils.safe_get_full_fp32_param(p).detach().clone()
    else:
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
    cli = moe_diff.parser(__doc__, PAIRS, 29771)
    cli.add_argument("--bf16", action="store_true", help='train both sides with "bf16": {"enabled": true}')
    args = cli.parse_args()
    if args.bf16:  # (read by _config in the phases, which inherit the environment)
        os.environ[BF16_ENV] = "1"
        args.pairs = BF16_PAIRS if args.pairs == PAIRS else args.pairs
    moe_diff.drive(args, zerospeed_run, deepspeed_run, __file__)


if __name__ == "__main__":
    main()
