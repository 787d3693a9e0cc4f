"""zerospeed against the real DeepSpeed on the same runs: one script, run by each library's Python.

    .venv/bin/python benchmarks/deepspeed_differential.py --deepspeed-python /tmp/dsvenv/bin/python

`--deepspeed-python` is a Python with the real DeepSpeed installed (its own virtual environment:
`python -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed`); this repository's
Python runs zerospeed through its `deepspeed` shim. Each case trains the same 4-8-3 MLP with a LayerNorm
(2 gloo ranks, 2 accumulation steps, 8 steps, the same batches) from `import deepspeed` in both, and the
table gives the largest |Δ| of the per-step mean loss and of the learning rate, or the error one of them
raised. A case DeepSpeed refuses is a configuration DeepSpeed does not support (zerospeed may).

    .venv/bin/python benchmarks/deepspeed_differential.py --deepspeed-python /work/dsvenv/bin/python --export

`--export` checks the other direction (DeepSpeed reads ours), for each PAIR `S:T` of `--export-pairs`:
zerospeed trains the fixture's MLP (a buffer, AdamW, WarmupLR, 2 ranks, 2 accumulation steps) at ZeRO S for
3 steps, saves, and goes on for 3 more; `zerospeed-ckpt export --to deepspeed --stage T --dp 2` writes the
step-3 tag in DeepSpeed's layout; the real DeepSpeed builds the same run at ZeRO T, `load_checkpoint`s the
export and trains the same 3 steps. The table gives the largest |Δ| between the two continuations' losses
and between DeepSpeed's `zero_to_fp32` of the export (ZeRO 1-3; at ZeRO 0 its module after the load) and
zerospeed's own consolidation of the step-3 tag. A PAIR `bS:T` trains with `bf16: {enabled: true}` on both
sides, with `data_types.grad_accum_dtype: "fp32"` (the export is then DeepSpeed's bf16 layout:
`bf16_zero_pp_rank_*` files, BF16_Optimizer's at ZeRO 1).
`--as-saved` (with `--export`) checks DeepSpeed reading zerospeed's own tag as saved: zerospeed trains and
saves at ZeRO S with `checkpoint.deepspeed_layout: true` (no export step), DeepSpeed `load_checkpoint`s that tag
at ZeRO S on the same 2 ranks and trains steps 4-6; the weight column compares DeepSpeed's module right after
the load with zerospeed's consolidation of the tag (pairs default to `0:0 1:1 2:2 3:3`); `--sub-group-size N` sets
`zero_optimization.sub_group_size` in both runs (N = 30 cuts the MLP's 83 parameters into 2 sub-groups);
`--two-groups` gives both runs two optimizer param groups (the matrices; the rest without weight decay);
`--bucket-size N` sets `reduce_bucket_size` and `allgather_bucket_size` in both runs (zerospeed's ZeRO 1/2 then
cut the group into several buckets, each split over the ranks apart).
`S:uN` exports a universal folder that DeepSpeed loads at ZeRO N with `checkpoint.load_universal`; `S:xN`
exports DeepSpeed's layout at ZeRO N, converts it with DeepSpeed's own `ds_to_universal`, and DeepSpeed loads
that universal folder at ZeRO N.
"""

import argparse
import json
import os
import shutil
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


EXPORT_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
}


def export_model():
    m = model()
    m.register_buffer("scale", torch.tensor([2.0]))
    return m


def export_run(rank, world, phase, stage, folder, port, bf16=False, as_saved=False, sub_group_size=None):
    """`phase` "zs": train 6 steps at `stage`, save after 3; "ds": load `folder`/ds (`as_saved`: `folder`/zs, the
    tag zerospeed saved with checkpoint.deepspeed_layout) and train steps 4-6."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    m = export_model()
    universal = stage >= 10  # (stage + 10: load the universal folder with checkpoint.load_universal)
    stage %= 10
    cfg = {**EXPORT_CONFIG, "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": universal}}
    if sub_group_size is not None:  # (both sides: DeepSpeed's ZeRO-3 sub-groups, zerospeed's as-saved layout)
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    if "--bucket-size" in sys.argv:  # (both sides; zerospeed's ZeRO 1/2 then cut several buckets, DeepSpeed alike)
        size = int(sys.argv[sys.argv.index("--bucket-size") + 1])
        cfg["zero_optimization"].update(reduce_bucket_size=size, allgather_bucket_size=size)
    if as_saved and phase == "zs":  # (a zerospeed key: DeepSpeed's config has no such key)
        cfg["checkpoint"]["deepspeed_layout"] = True
    if bf16:  # (fp32 accumulation: DeepSpeed's BF16_Optimizer at ZeRO 1)
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    params = m.parameters()
    if "--two-groups" in sys.argv:  # (both sides: weights, then biases and the LayerNorm without weight decay)
        params = [
            {"params": [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() > 1]},
            {"params": [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]},
        ]
        params[1]["weight_decay"] = 0.0
    eng, *_ = deepspeed.initialize(model=m, model_parameters=params, config=cfg)
    first = 0
    if phase == "ds":
        eng.load_checkpoint(os.path.join(folder, "zs" if as_saved else "ds"))
        first = 3
        if bf16:  # DeepSpeed's fp32 masters after the load (its zero_to_fp32 cannot read BF16_Optimizer files)
            sd = {k: v.detach().float().clone() for k, v in eng.module.named_buffers()}
            sd.update({n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in m.named_parameters()})
            if rank == 0:
                torch.save(sd, os.path.join(folder, "ds_fp32.pt"))
        elif stage == 0 or universal or as_saved:  # (collective at ZeRO 3)
            with deepspeed.zero.GatheredParameters(list(m.parameters()), enabled=stage == 3):
                sd = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
            if rank == 0:
                torch.save(sd, os.path.join(folder, "ds_fp32.pt"))
    losses = []
    for step, (x, y) in enumerate(batches()[:6]):
        if step < first:
            continue
        tot = 0.0
        for micro in range(2):
            lo = (micro * world + rank) * 2
            xx = x[lo : lo + 2].bfloat16() if bf16 else x[lo : lo + 2]
            loss = ((eng(xx).float() * m.scale.float() - y[lo : lo + 2]) ** 2).mean()
            eng.backward(loss)
            eng.step()
            tot += loss.item()
        t = torch.tensor([tot / 2])
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        if phase == "zs" and step == 2:
            eng.save_checkpoint(os.path.join(folder, "zs"), tag="step3")
    if rank == 0:
        json.dump({"losses": losses[-3:]}, open(os.path.join(folder, f"{phase}.json"), "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ds_zero_to_fp32(folder: str) -> None:
    """In DeepSpeed's Python: its own consolidation of the export."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(folder, "ds"))
    torch.save({k: v.clone() for k, v in sd.items()}, os.path.join(folder, "ds_fp32.pt"))


def _zs_consolidate(folder: str) -> None:
    from zerospeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(folder, "zs"))
    torch.save({k: v.clone() for k, v in sd.items()}, os.path.join(folder, "zs_fp32.pt"))


def _export_pair(
    python: str, src: int, dst: int, folder: str, port: int, bf16: bool = False, as_saved: bool = False
) -> str:
    """One table row for zerospeed at ZeRO `src` exported to DeepSpeed at ZeRO `dst` (`dst` + 10: exported as
    a universal folder, which DeepSpeed loads with `checkpoint.load_universal`; `dst` + 20: exported in
    DeepSpeed's layout at ZeRO `dst`, converted by DeepSpeed's `ds_to_universal`, loaded as universal)."""

    def step(py, *argv, done=None):
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        if done is not None and os.path.exists(done):
            os.remove(done)
        proc = subprocess.run([py, *argv], env=env, capture_output=True, text=True, timeout=600)
        # (DeepSpeed's ranks sometimes abort at exit, after the run wrote its result)
        if proc.returncode != 0 and not (done is not None and os.path.exists(done)):
            lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
            raise RuntimeError((lines[-1] if lines else proc.stderr.strip()[-300:])[:300])

    me = [__file__, *(["--bf16"] if bf16 else []), *(["--as-saved"] if as_saved else []), *_sub_group_arg()]
    me.append("--export-phase")
    label = f"{'b' if bf16 else ''}{src} | {_stage_name(dst)}"
    try:
        step(sys.executable, *me, "zs", "--stage", str(src), "--folder", folder, "--port", str(port))
        step(sys.executable, *me, "zs-fp32", "--folder", folder)
        cli = ["-m", "zerospeed.checkpoint.cli", "export", os.path.join(folder, "zs"), os.path.join(folder, "ds")]
        if as_saved:
            pass  # DeepSpeed reads zerospeed's tag itself
        elif 10 <= dst < 20:
            step(sys.executable, *cli, "--to", "universal", "--dp", "2")
        else:
            step(sys.executable, *cli, "--to", "deepspeed", "--stage", str(dst % 10), "--dp", "2")
        if dst >= 20:  # DeepSpeed's own converter reads the export
            tag = os.path.join(folder, "ds", "step3")
            convert = ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag]
            step(python, *convert, "--output_folder", tag + "_universal", "--inject_missing_state")
            with open(os.path.join(folder, "ds", "latest_universal"), "w") as f:
                f.write("step3_universal")
            dst -= 10
        done = os.path.join(folder, "ds.json")
        step(python, *me, "ds", "--stage", str(dst), "--folder", folder, "--port", str(port + 1), done=done)
        if 0 < dst < 10 and not bf16 and not as_saved:
            step(python, *me, "ds-fp32", "--folder", folder)
        if as_saved and dst == 0:  # (ZeRO 0: no zero_to_fp32; the weight column is DeepSpeed's module after the load)
            shutil.copy(os.path.join(folder, "ds_fp32.pt"), os.path.join(folder, "loaded_fp32.pt"))
        elif as_saved:  # DeepSpeed's own zero_to_fp32 reads the tag as saved too
            os.replace(os.path.join(folder, "ds_fp32.pt"), os.path.join(folder, "loaded_fp32.pt"))
            os.symlink(os.path.join(folder, "zs"), os.path.join(folder, "ds"))
            step(python, *me, "ds-fp32", "--folder", folder)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"| {label} | | | {exc} |"
    a, b = (json.load(open(os.path.join(folder, f"{k}.json")))["losses"] for k in ("zs", "ds"))
    dl = max(abs(x - y) for x, y in zip(a, b))
    zs_w, ds_w = (torch.load(os.path.join(folder, f"{k}_fp32.pt")) for k in ("zs", "ds"))
    if set(zs_w) != set(ds_w):
        return f"| {label} | {dl:.1e} | | keys differ: {sorted(set(zs_w) ^ set(ds_w))} |"
    dw = max((zs_w[k].float() - ds_w[k].float()).abs().max().item() for k in zs_w)
    note = ""
    if as_saved:  # (the weight column: DeepSpeed's module after the load; zero_to_fp32 of the tag in the notes)
        loaded = torch.load(os.path.join(folder, "loaded_fp32.pt"))
        dw, zero_to_fp32 = max((zs_w[k].float() - loaded[k].float()).abs().max().item() for k in zs_w), dw
        note = f"; DeepSpeed's zero_to_fp32 of the tag: max |Δ weight| {zero_to_fp32:.1e}" if dst else ""
    return f"| {label} | {dl:.1e} | {dw:.1e} | DeepSpeed losses {', '.join(f'{v:.6f}' for v in b)}{note} |"


def _sub_group_arg() -> list[str]:
    """`--sub-group-size N`, `--bucket-size N` and `--two-groups` as this run was given them (passed on to each
    phase)."""
    out = ["--two-groups"] if "--two-groups" in sys.argv else []
    if "--bucket-size" in sys.argv:
        i = sys.argv.index("--bucket-size")
        out += sys.argv[i : i + 2]
    if "--sub-group-size" not in sys.argv:
        return out
    i = sys.argv.index("--sub-group-size")
    return out + sys.argv[i : i + 2]


def _stage_name(dst: int) -> str:
    return f"x{dst - 20}" if dst >= 20 else f"u{dst - 10}" if dst >= 10 else str(dst)


def _export_main(python: str, pairs: list[str], port: int, as_saved: bool = False) -> None:
    print(f"torch {torch.__version__}; 2 gloo ranks on the CPU; zerospeed saves at ZeRO S, DeepSpeed resumes at T\n")
    print("(T = uN: the export is a universal folder, DeepSpeed loads it at ZeRO N with checkpoint.load_universal;")
    print("T = xN: the export at ZeRO N, converted by DeepSpeed's ds_to_universal, loaded the same way; for both")
    print("the weight column compares DeepSpeed's module after that load. bS: bf16, DeepSpeed's fp32 masters)\n")
    print("| S (zerospeed) | T (DeepSpeed) | max |Δ loss| steps 4-6 | max |Δ weight| (zero_to_fp32) | notes |")
    print("|---|---|---:|---:|---|")
    for i, pair in enumerate(pairs):
        src, dst = pair.split(":")
        bf16 = src.startswith("b")
        offset = {"u": 10, "x": 20}.get(dst[0], 0)
        src, dst = int(src.lstrip("b")), int(dst.lstrip("ux")) + offset
        with tempfile.TemporaryDirectory() as tmp:
            print(_export_pair(python, src, dst, tmp, port + 2 * i, bf16, as_saved), flush=True)


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
    ap.add_argument("--export", action="store_true", help="export zerospeed checkpoints and resume them in DeepSpeed")
    ap.add_argument(
        "--export-pairs",
        nargs="*",
        default=[
            "0:0",
            "1:1",
            "2:2",
            "3:3",
            "1:3",
            "3:2",
            "2:u2",
            "1:u3",
            "b1:1",
            "b3:1",
            "b1:2",
            "b2:3",
            "1:x2",
            "3:x3",
        ],
    )
    ap.add_argument("--bf16", action="store_true", help="(an export phase) train with bf16")
    ap.add_argument("--as-saved", action="store_true", help="DeepSpeed loads zerospeed's ZeRO 0-3 tag as saved")
    ap.add_argument("--sub-group-size", type=int, help="zero_optimization.sub_group_size of both runs")
    ap.add_argument("--two-groups", action="store_true", help="two optimizer param groups in both runs")
    ap.add_argument("--bucket-size", type=int, help="zero_optimization.reduce/allgather_bucket_size of both runs")
    ap.add_argument("--export-phase", choices=["zs", "ds", "zs-fp32", "ds-fp32"])
    ap.add_argument("--stage", type=int), ap.add_argument("--folder")
    args = ap.parse_args()
    if args.case:
        return _case_main(args.case, args.out, args.port)
    if args.export_phase in ("zs", "ds"):
        return mp.spawn(
            export_run,
            args=(
                2,
                args.export_phase,
                args.stage,
                args.folder,
                args.port,
                args.bf16,
                args.as_saved,
                args.sub_group_size,
            ),
            nprocs=2,
        )
    if args.export_phase:
        return (_zs_consolidate if args.export_phase == "zs-fp32" else _ds_zero_to_fp32)(args.folder)
    if not args.deepspeed_python:
        raise SystemExit("--deepspeed-python is required (a Python with the real DeepSpeed installed)")
    if args.export:
        as_saved_pairs = ["0:0", "1:1", "2:2", "3:3"]
        pairs = as_saved_pairs if args.as_saved and "--export-pairs" not in sys.argv else args.export_pairs
        return _export_main(args.deepspeed_python, pairs, args.port, args.as_saved)
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
