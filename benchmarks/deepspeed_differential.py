"""zerospeed against the real DeepSpeed on the same runs: one script, run by each library's Python.

    .venv/bin/python benchmarks/deepspeed_differential.py --deepspeed-python /tmp/dsvenv/bin/python

`--deepspeed-python` is a Python with the real DeepSpeed installed (its own virtual environment:
`python -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed`); this repository's
Python runs zerospeed through its `deepspeed` shim. Each case trains the same 4-8-3 MLP with a LayerNorm
(2 gloo ranks, 2 accumulation steps, 8 steps, the same batches) from `import deepspeed` in both, and the
table gives the largest |Δ| of the per-step mean loss and of the learning rate, or the error one of them
raised. A case DeepSpeed refuses is a configuration DeepSpeed does not support (zerospeed may).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

CASES = {
    "sgd_z1_no_flag": {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}},
    "adamw_z0": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
    },
    "adam_z1_decay": {
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 8, "warmup_max_lr": 1e-2},
        },
        "zero_optimization": {"stage": 1},
    },
    "adam_nowd_mode_z2": {
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True, "adam_w_mode": False},
        },
        "zero_optimization": {"stage": 2},
    },
    "sgd_mom_z2_onecycle": {
        "optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3},
        },
        "zero_optimization": {"stage": 2},
    },
    "adamw_z3_clip05_predivide": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 0.5,
        "gradient_predivide_factor": 2.0,
        "zero_optimization": {"stage": 3},
    },
    "adamw_z2_prescale": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "prescale_gradients": True,
        "zero_optimization": {"stage": 2},
    },
    "adamw_z1_bf16": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
    },
    "adamw_z1_bf16_comm_bf16": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "zero_optimization": {"stage": 1},
    },
    "adamw_z3_bf16": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    },
    "autocast_bf16_z2": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_optimization": {"stage": 2},
    },
    "autocast_bf16_z3": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_optimization": {"stage": 3},
    },
    "bf16_masters_z2": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "zero_optimization": {"stage": 2},
    },
    "bf16_grad_accum_bf16_z1": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "bf16"},
        "zero_optimization": {"stage": 1},
    },
    "mics_z3_4ranks": {
        "world": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "mics_shard_size": 2},
    },
    "warmuplr_lin": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": 0},
    },
    "lrrange": {
        "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
        "zero_allow_untested_optimizer": True,
        "scheduler": {
            "type": "LRRangeTest",
            "params": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.5},
        },
        "zero_optimization": {"stage": 1},
    },
    "warmupcosine": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 2}},
        "zero_optimization": {"stage": 2},
    },
}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(8)]


def run(rank, world, name, out, port):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    m = model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4 // world,
        **{k: v for k, v in CASES[name].items() if k != "world"},
    }
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    losses, lrs = [], []
    for x, y in batches():
        tot = 0.0
        gas = 4 // world
        for micro in range(gas):
            lo = (micro * world + rank) * 2
            xx = x[lo : lo + 2]
            if cfg.get("bf16", {}).get("enabled"):
                xx = xx.bfloat16()
            loss = ((eng(xx).float() - y[lo : lo + 2]) ** 2).mean()
            eng.backward(loss)
            eng.step()
            tot += loss.item()
        t = torch.tensor([tot / gas])
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        lrs.append(eng.get_lr()[0])
    if rank == 0:
        json.dump({"losses": losses, "lrs": lrs}, open(out, "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _case_main(name: str, out: str, port: int) -> None:
    world = CASES[name].get("world", 2)
    mp.spawn(run, args=(world, name, out, port), nprocs=world)


def _run_case(python: str, name: str, out: str, port: int) -> str | None:
    """None, or the last line of the error the run raised."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [python, __file__, "--case", name, "--out", out, "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if os.path.exists(out):  # (DeepSpeed's ranks sometimes abort at exit, after the run)
        return None
    lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln and "Warning" not in ln]
    return (lines[-1] if lines else proc.stderr.strip().splitlines()[-1])[:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed-python", help="a Python with the real DeepSpeed installed")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--case"), ap.add_argument("--out"), ap.add_argument("--port", type=int, default=29700)
    args = ap.parse_args()
    if args.case:
        return _case_main(args.case, args.out, args.port)
    if not args.deepspeed_python:
        raise SystemExit("--deepspeed-python is required (a Python with the real DeepSpeed installed)")
    print(f"torch {torch.__version__}; 2 gloo ranks on the CPU\n")
    print("| case | config | max |Δ loss| | max |Δ lr| | notes |")
    print("|---|---|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.cases):
            outs = {lib: os.path.join(tmp, f"{lib}_{name}.json") for lib in ("ds", "zs")}
            errors = {
                "ds": _run_case(args.deepspeed_python, name, outs["ds"], args.port + 2 * i),
                "zs": _run_case(sys.executable, name, outs["zs"], args.port + 2 * i + 1),
            }
            cfg = json.dumps(CASES[name]).replace("|", "/")
            if any(errors.values()):
                note = "; ".join(
                    f"{'DeepSpeed' if k == 'ds' else 'zerospeed'} refuses: {v}" for k, v in errors.items() if v
                )
                print(f"| {name} | `{cfg}` | | | {note} |")
                continue
            a, b = (json.load(open(outs[k])) for k in ("ds", "zs"))
            dl = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
            dr = max(abs(x - y) for x, y in zip(a["lrs"], b["lrs"]))
            print(f"| {name} | `{cfg}` | {dl:.1e} | {dr:.1e} | |")


if __name__ == "__main__":
    main()
