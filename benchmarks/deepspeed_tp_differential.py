"""The real DeepSpeed resumes zerospeed's tensor-parallel checkpoints (`zerospeed-ckpt export --to deepspeed --tp 2`).

    .venv/bin/python benchmarks/deepspeed_tp_differential.py --deepspeed-python /work/dsvenv/bin/python

For each PAIR `S:T` of `--pairs` (`fS:T`: make_tp_fused.py's model with a fused q|k|v weight and its
partition_config instead): zerospeed trains the tiny Llama of tests/fixtures/deepspeed_0.19.8/make_tp.py
with its AutoTP (`tensor_parallel.autotp_size: 2`, 2 gloo ranks, AdamW, WarmupLR, clipping 1.0) at ZeRO S for
3 steps, saves, and goes on for 3 more; `zerospeed-ckpt export --to deepspeed --tp 2 --stage T --dp 1` writes
the step-3 tag as DeepSpeed's AutoTP tag; the real DeepSpeed (transformers installed beside it) builds the
same run with `autotp_size: 2` at ZeRO T, `load_checkpoint`s the export and trains the same 3 steps. The table
gives the largest |Δ| between the two continuations' losses and between DeepSpeed's consolidated weights right
after the load (its `_consolidated_16bit_state_dict`, which gathers the tp shards) and zerospeed's gathered
step-3 weights.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "fixtures", "deepspeed_0.19.8"))
import make_tp  # noqa: E402
import make_tp_fused  # noqa: E402


def _run_of(fused: bool):
    """(model, config for a ZeRO stage, batches, loss of a batch) of make_tp.py's Llama or make_tp_fused.py's model."""
    if fused:

        def cfg(stage):
            return {**make_tp_fused.config(), "zero_optimization": {"stage": stage}}

        return make_tp_fused.Fused, cfg, make_tp_fused.batches, lambda eng, ids: eng(ids)
    return make_tp.model, make_tp.config, make_tp.batches, lambda eng, ids: eng(input_ids=ids, labels=ids).loss


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def zerospeed_run(rank, world, stage, folder, port, fused):
    _env(rank, world, port)
    import zerospeed
    from zerospeed.parallel.tensor import full_state_dict

    model, config, batches, forward = _run_of(fused)
    m = model()
    cfg = config(stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    eng, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    losses = []
    for step, ids in enumerate(batches()):
        loss = forward(eng, ids)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        if step == 2:
            eng.save_checkpoint(os.path.join(folder, "zs"), tag="step3")
            with zerospeed.zero.GatheredParameters(list(m.parameters())):
                weights = {k: v.detach().clone() for k, v in full_state_dict(m, eng.mesh.group("tp")).items()}
    if rank == 0:
        torch.save({"losses": losses, "step3": weights}, os.path.join(folder, "zs_run.pt"))
    zerospeed.comm.barrier()


def deepspeed_run(rank, world, stage, folder, port, fused):
    _env(rank, world, port)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model, config, batches, forward = _run_of(fused)
    m = model()
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config(stage))
    eng.load_checkpoint(os.path.join(folder, "ds"))
    loaded = eng._consolidated_16bit_state_dict()  # (replicated tensors alias the live weights on a CPU)
    loaded = None if loaded is None else {k: v.float().clone() for k, v in loaded.items()}
    losses = []
    for ids in batches()[3:]:
        loss = forward(eng, ids)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    if rank == 0:
        torch.save(
            {"losses": losses, "loaded": loaded, "steps": eng.global_steps},
            os.path.join(folder, "ds_run.pt"),
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _pair(python: str, src: int, dst: int, folder: str, port: int, fused: bool) -> str:
    me = os.path.abspath(__file__)
    extra = ["--fused"] if fused else []
    zs = [sys.executable, me, "--phase", "zs", "--stage", str(src), "--folder", folder, "--port", str(port), *extra]
    subprocess.run(zs, check=True)
    cli = [sys.executable, "-m", "zerospeed.checkpoint.cli", "export", os.path.join(folder, "zs")]
    cli += [os.path.join(folder, "ds"), "--to", "deepspeed", "--stage", str(dst), "--dp", "1", "--tp", "2"]
    subprocess.run(cli, check=True, cwd=os.path.join(HERE, ".."))
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    ds = [python, me, "--phase", "ds", "--stage", str(dst), "--folder", folder, "--port", str(port + 1), *extra]
    proc = subprocess.run(ds, env=env, capture_output=True, text=True)
    if proc.returncode != 0 and not os.path.exists(os.path.join(folder, "ds_run.pt")):  # (an abort at exit is fine)
        return "DeepSpeed failed: " + proc.stderr.strip().splitlines()[-1]
    zs = torch.load(os.path.join(folder, "zs_run.pt"), weights_only=False)
    got = torch.load(os.path.join(folder, "ds_run.pt"), weights_only=False)
    dloss = max(abs(a - b) for a, b in zip(zs["losses"][3:], got["losses"]))
    dw = max((got["loaded"][k] - v.float()).abs().max().item() for k, v in zs["step3"].items())
    return json.dumps({"max_dloss": dloss, "max_dweight_after_load": dw, "ds_steps": got["steps"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    ap.add_argument(
        "--pairs", nargs="*", default=["0:0", "1:1", "2:1", "3:2", "f1:1"], help="S:T; fS:T: make_tp_fused.py's model"
    )
    ap.add_argument("--fused", action="store_true", help="(a phase) make_tp_fused.py's model")
    ap.add_argument("--phase", choices=["zs", "ds"]), ap.add_argument("--stage", type=int)
    ap.add_argument("--folder"), ap.add_argument("--port", type=int, default=29761)
    args = ap.parse_args()
    if args.phase:
        fn = zerospeed_run if args.phase == "zs" else deepspeed_run
        mp.spawn(fn, args=(2, args.stage, args.folder, args.port, args.fused), nprocs=2)
        return
    print("| zerospeed ZeRO (tp 2) : DeepSpeed ZeRO (autotp 2) | max |Δ loss| steps 4-6 | max |Δ w| after load |")
    print("|---|---|---|")
    for i, pair in enumerate(args.pairs):
        fused = pair.startswith("f")
        src, dst = (int(x) for x in pair.removeprefix("f").split(":"))
        with tempfile.TemporaryDirectory() as folder:
            result = _pair(args.deepspeed_python, src, dst, folder, args.port + 2 * i, fused)
        try:
            r = json.loads(result)
            assert r["ds_steps"] == 6, r
            print(f"| {pair} | {r['max_dloss']:.3g} | {r['max_dweight_after_load']:.3g} |", flush=True)
        except json.JSONDecodeError:
            print(f"| {pair} | {result} | |", flush=True)


if __name__ == "__main__":
    main()
