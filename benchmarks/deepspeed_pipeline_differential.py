"""The real DeepSpeed resumes a zerospeed pipeline checkpoint exported to its layout, or as a universal folder (Note
[pipeline export] and Note [DeepSpeed pipeline universal folders] in zerospeed/checkpoint/deepspeed_pipeline.py), and
continues as zerospeed does. One script, run by each library's Python:

    python benchmarks/deepspeed_pipeline_differential.py --deepspeed-python /work/dsvenv/bin/python [--universal]

zerospeed's PipelineEngine (through its `deepspeed` shim) trains the tied model of
tests/fixtures/deepspeed_0.19.8/make_pipe_tied.py (a tied Linear first and, through a forward_fn, last; 2 stages x dp
ranks, AdamW, WarmupLR, micro-batches of 2, fp32) at ZeRO 0 (`--zs-zero Z`: ZeRO Z, 0-2) for 3 steps, saves, and trains
3 more, saving again.

- Default, for each case (DeepSpeed's ZeRO stage T, data-parallel size dp): zerospeed trains on 2 x dp ranks with 4
  micro-batches per rank; `zerospeed-ckpt export --to deepspeed --stage T --dp dp` writes the step-3 tag in
  DeepSpeed's pipeline layout; the real DeepSpeed builds the same run at ZeRO T, `load_checkpoint`s the export and
  trains the same 3 steps. gradient_clipping is 1.0 at T = 1 (DeepSpeed's ZeRO-1 norm spans the stages, as
  zerospeed's) and 0 at T = 0 (DeepSpeed's fp32 ZeRO-0 pipeline clips by the first stage's norm: docs/pipeline.md).
- `--universal`: zerospeed trains once on 2 x 2 ranks (clipping 1.0); `zerospeed-ckpt export --to universal --dp 2`
  writes the step-3 tag as a universal folder; for each dp the real DeepSpeed builds the model (other initial
  weights) on 2 stages x dp ranks at ZeRO 1 with `checkpoint.load_universal: true`, loads the folder and trains the
  same 3 steps on the same global batch (8 / dp micro-batches per rank).

- `--tp 2` (Note [pipeline export with tp] in zerospeed/checkpoint/deepspeed_pipeline_tp.py): the model of
  make_pipe_tp.py on 2 stages x tp 2 (4 ranks, PipeModelDataParallelTopology), zerospeed's run with its own
  Column/RowParallelLinear cut from the same full layers, ZeRO 0, gradient_clipping 0; `export --to deepspeed --stage
  T --dp 1` (T = 0, 1); the real DeepSpeed runs the fixture's plain-torch.distributed layers, loads the export and
  trains steps 4-6. Its step-6 layer files are joined over the tp ranks (make_pipe_tp.join_full) for the weights.
  With `--zs-zero Z` zerospeed's run is at ZeRO Z (its flat files joined over tp by the export); with `--universal`
  `export --to universal --dp 1` and the real DeepSpeed (other initial weights, ZeRO 1, `checkpoint.load_universal`)
  loads the folder.

The table gives the largest |Δ| between the two continuations' losses and between the two step-6 layer files.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

# The fixture's tied model and batches (its layers() takes `deepspeed.pipe.TiedLayerSpec`: the real one, or
# zerospeed's through its `deepspeed` shim)
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "deepspeed_0.19.8")
)
from make import config  # noqa: E402
from make_pipe_tied import batches, layers  # noqa: E402

CASES = [(0, 1), (0, 2), (1, 2), (1, 1)]  # (DeepSpeed's ZeRO stage, data-parallel size)
UNIVERSAL_CASES = [(1, 2), (1, 1)]  # DeepSpeed loads the universal folder at ZeRO 1 (the zerospeed run: dp 2)


def run(rank, world, phase, stage, folder, port, universal, zs_zero=0):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1 if universal and phase == "ds" else 0)  # (universal: the load must bring the weights)
    net = PipelineModule(layers=layers(), num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    dp = world // 2
    gas = 8 // dp if universal else 4  # universal: the zerospeed run's global batch (2 ranks x 4 micro-batches)
    clipping = 1.0 if stage == 1 else 0.0
    cfg = config(zs_zero if phase == "zs" else stage, gradient_accumulation_steps=gas, gradient_clipping=clipping)
    if universal and phase == "ds":
        cfg["checkpoint"] = {"load_universal": True}
    eng, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    d = eng.grid.data_parallel_id if phase == "ds" else rank % dp  # zerospeed's grid: rank = stage * dp + d
    first = 0
    if phase == "ds":
        eng.load_checkpoint(os.path.join(folder, "uni" if universal else "ds"))
        first = 3
    losses = []
    for step, (x, y) in enumerate(batches(2 if universal else dp)):
        if step < first:
            continue
        micro = iter([(x[(i * dp + d) * 2 :][:2], y[(i * dp + d) * 2 :][:2]) for i in range(gas)])
        losses.append(float(eng.train_batch(data_iter=micro)))
        if phase == "zs" and step in (2, 5):
            eng.save_checkpoint(os.path.join(folder, "zs"), tag=f"step{step + 1}")
    _finish(eng, rank, phase, folder, losses)


def _finish(eng, rank: int, phase: str, folder: str, losses: list[float]) -> None:
    """DeepSpeed's step-6 tag (phase "ds") and the continuation's losses (rank 0); the process group closed."""
    if phase == "ds":
        eng.save_checkpoint(os.path.join(folder, "ds_after"), tag="step6")
    if rank == 0:
        torch.save(losses[-3:], os.path.join(folder, f"{phase}_losses.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_tp(rank, world, phase, stage, folder, port, universal=False, zs_zero=0):
    """`--tp 2`: make_pipe_tp.py's model on 2 stages x tp 2; zerospeed's own tensor-parallel layers (phase "zs",
    ZeRO `zs_zero`, 3 + 3 steps, saved at 3 and 6) or the fixture's plain ones under the real DeepSpeed (phase "ds":
    loads the export, or with `universal` the universal folder into other initial weights, trains steps 4-6, saves
    step 6)."""
    import make_pipe_tp

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    if phase == "ds":
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

        topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
        grid = PipelineParallelGrid(topology=topo)
        specs = make_pipe_tp.layers(grid.get_slice_parallel_group(), 2, grid.get_slice_parallel_rank())
        if universal:  # (other initial weights: the load must bring them)
            torch.manual_seed(5)
            with torch.no_grad():
                for p in (p for layer in specs for p in layer.parameters()):
                    p.add_(torch.randn(p.shape))
    else:
        from zerospeed.comm.mesh import ParallelMesh
        from zerospeed.parallel.pipeline.topology import PipeModelDataParallelTopology

        topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
        specs = make_pipe_tp.zerospeed_layers(ParallelMesh.from_grid(topo.to_grid()).group("tp"))
    net = PipelineModule(layers=specs, topology=topo, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = config(stage if phase == "ds" else zs_zero, gradient_accumulation_steps=4, gradient_clipping=0.0)
    if universal and phase == "ds":
        cfg["checkpoint"] = {"load_universal": True}
    eng, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    first = 3 if phase == "ds" else 0
    if phase == "ds":
        eng.load_checkpoint(os.path.join(folder, "uni" if universal else "ds"))
    losses = []
    for step, (x, y) in enumerate(make_pipe_tp.batches(1)):
        if step >= first:
            losses.append(float(eng.train_batch(data_iter=iter(make_pipe_tp.micro_batches(x, y, 1, 0)))))
        if phase == "zs" and step in (2, 5):
            eng.save_checkpoint(os.path.join(folder, "zs"), tag=f"step{step + 1}")
    _finish(eng, rank, phase, folder, losses)


def _compare_tp(folder: str) -> dict:
    import make_pipe_tp

    zs, ds = (torch.load(os.path.join(folder, f"{p}_losses.pt")) for p in ("zs", "ds"))
    weights = 0.0
    for path in sorted(glob.glob(os.path.join(folder, "ds_after", "step6", "layer_*-model_00-model_states.pt"))):
        idx = int(os.path.basename(path)[6:8])
        states = [torch.load(path.replace("-model_00-", f"-model_{t:02d}-")) for t in range(2)]
        mine = torch.load(os.path.join(folder, "zs", "step6", f"layer_{idx:02d}-model_states.pt"))
        for k, v in make_pipe_tp.join_full(states, f"{idx}.").items():
            weights = max(weights, (v - mine[k.partition(".")[2]]).abs().max().item())
    return {"zs": zs, "ds": ds, "loss": max(abs(a - b) for a, b in zip(zs, ds)), "weights": weights}


def _tp_cases(python: str, port: int, universal: bool, zz: int):
    if universal:  # (DeepSpeed loads the universal folder at ZeRO 1)
        with tempfile.TemporaryDirectory() as folder:
            _phase(sys.executable, "zs", 1, 4, folder, port, True, zz, tp=2)
            _export(folder, [os.path.join(folder, "uni"), "--to", "universal", "--dp", "1"])
            _phase(python, "ds", 1, 4, folder, port + 1, True, tp=2)
            yield 1, 1, _compare_tp(folder)
        return
    for i, stage in enumerate((0, 1)):
        with tempfile.TemporaryDirectory() as folder:
            _phase(sys.executable, "zs", stage, 4, folder, port + 2 * i, False, zz, tp=2)
            _export(folder, [os.path.join(folder, "ds"), "--to", "deepspeed", "--stage", str(stage), "--dp", "1"])
            _phase(python, "ds", stage, 4, folder, port + 2 * i + 1, False, tp=2)
            yield stage, 1, _compare_tp(folder)


def _phase(
    py: str, phase: str, stage: int, world: int, folder: str, port: int, universal: bool, zz: int = 0, tp: int = 1
) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    argv = [py, __file__, "--phase", phase, str(stage), str(world), folder, str(port), *(["--universal"] * universal)]
    argv += ["--tp", str(tp)] if tp > 1 else []
    argv += ["--zs-zero", str(zz)] if phase == "zs" else []
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{py} {argv[2:]}: {proc.stderr[-3000:]}")


def _export(folder: str, argv: list[str]) -> None:
    from zerospeed.checkpoint.cli import main as ckpt

    if ckpt(["export", os.path.join(folder, "zs"), *argv, "--tag", "step3"]) != 0:
        raise RuntimeError(f"export {argv} failed")


def _compare(folder: str) -> dict:
    zs, ds = (torch.load(os.path.join(folder, f"{p}_losses.pt")) for p in ("zs", "ds"))
    weights = 0.0
    for path in sorted(glob.glob(os.path.join(folder, "ds_after", "step6", "layer_*-model_states.pt"))):
        mine = torch.load(os.path.join(folder, "zs", "step6", os.path.basename(path)))
        for k, v in torch.load(path).items():
            weights = max(weights, (v - mine[k]).abs().max().item())
    return {"zs": zs, "ds": ds, "loss": max(abs(a - b) for a, b in zip(zs, ds)), "weights": weights}


def _cases(python: str, port: int, universal: bool, zz: int):
    """(stage, dp, comparison) of each case."""
    if universal:
        with tempfile.TemporaryDirectory() as folder:
            _phase(sys.executable, "zs", 1, 4, folder, port, True, zz)
            _export(folder, [os.path.join(folder, "uni"), "--to", "universal", "--dp", "2"])
            for i, (stage, dp) in enumerate(UNIVERSAL_CASES):
                _phase(python, "ds", stage, 2 * dp, folder, port + 1 + i, True)
                yield stage, dp, _compare(folder)
        return
    for i, (stage, dp) in enumerate(CASES):
        with tempfile.TemporaryDirectory() as folder:
            _phase(sys.executable, "zs", stage, 2 * dp, folder, port + 2 * i, False, zz)
            _export(folder, [os.path.join(folder, "ds"), "--to", "deepspeed", "--stage", str(stage), "--dp", str(dp)])
            _phase(python, "ds", stage, 2 * dp, folder, port + 2 * i + 1, False)
            yield stage, dp, _compare(folder)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--port", type=int, default=29781)
    parser.add_argument("--universal", action="store_true", help="export as a universal folder instead")
    parser.add_argument("--zs-zero", type=int, default=0, help="zerospeed's ZeRO stage (0-2) in its run")
    parser.add_argument("--tp", type=int, default=1, help="2: the pipeline x tensor-parallel model (make_pipe_tp.py)")
    parser.add_argument("--phase", nargs=5, default=None, metavar=("PHASE", "STAGE", "WORLD", "FOLDER", "PORT"))
    args = parser.parse_args()
    if args.phase:
        phase, stage, world, folder, port = args.phase
        if args.tp > 1:
            argv = (int(world), phase, int(stage), folder, int(port), args.universal, args.zs_zero)
            mp.spawn(run_tp, args=argv, nprocs=int(world))
            return
        mp.spawn(
            run,
            args=(int(world), phase, int(stage), folder, int(port), args.universal, args.zs_zero),
            nprocs=int(world),
        )
        return
    print("| DeepSpeed ZeRO | dp | max abs dloss (steps 4-6) | max abs dweight (step 6) |")
    print("|---|---|---|---|")
    cases = _tp_cases(args.deepspeed_python, args.port, args.universal, args.zs_zero) if args.tp > 1 else None
    for stage, dp, r in cases or _cases(args.deepspeed_python, args.port, args.universal, args.zs_zero):
        print(f"| {stage} | {dp} | {r['loss']:.2e} | {r['weights']:.2e} |", flush=True)
        print(json.dumps({"zerospeed": r["zs"], "deepspeed": r["ds"]}), file=sys.stderr)


if __name__ == "__main__":
    main()
