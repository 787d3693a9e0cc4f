"""Train a small OpenFold-style Evoformer on DS4Sci_EvoformerAttention through zerospeed, the DeepSpeed way.

    cd examples/evoformer
    zerospeed --num_gpus 2 train_evoformer.py --deepspeed_config ds_config_zero2.json   # or ds_config_zero3.json

The model (examples/zoo/evoformer.py) runs the four attentions of DeepSpeed's DS4Sci tutorial: MSA row
attention with pair bias, MSA column attention, triangle attention around the starting and the ending node,
each through `from zerospeed.ops.deepspeed4science import DS4Sci_EvoformerAttention` (the same import as
`deepspeed.ops.deepspeed4science` through the shim). The data are a deterministic toy MSA and pair features
with random masks; the loss is a regression of both representations. `--attention naive` swaps in the
materialised-logits attention for comparison. One process (`python examples/evoformer/train_evoformer.py
...`) works too.
"""

from __future__ import annotations

import argparse
import time

import zerospeed
import zerospeed.comm as comm
from zoo.evoformer import Evoformer, EvoformerConfig, evoformer_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--seqs", type=int, default=16, help="MSA sequences (N_seq)")
    parser.add_argument("--residues", type=int, default=64, help="residues (N_res)")
    parser.add_argument("--blocks", type=int, default=2, help="Evoformer blocks")
    parser.add_argument("--attention", choices=("evoformer", "naive"), default="evoformer")
    parser.add_argument("--seed", type=int, default=0, help="model-initialisation seed")
    zerospeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    import torch

    args = parse_args()
    zerospeed.init_distributed()
    torch.manual_seed(args.seed)
    model = Evoformer(EvoformerConfig(blocks=args.blocks, attention=args.attention))
    engine, *_ = zerospeed.initialize(args=args, model=model, model_parameters=model.parameters())
    world, rank, micro = comm.get_world_size(), comm.get_rank(), engine.train_micro_batch_size_per_gpu()
    start = time.perf_counter()
    for step in range(args.steps):
        # one global batch per step, this rank's slice of it (the same batches at any world size)
        batch = evoformer_batch(world * micro, args.seqs, args.residues, seed=step)
        loss = engine(*(t[rank * micro : (rank + 1) * micro] for t in batch))
        engine.backward(loss)
        engine.step()
        mean = torch.tensor([loss.item()])
        comm.all_reduce(mean, op="avg")
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean.item():.4f}", flush=True)
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s ({args.attention} attention)", flush=True)


if __name__ == "__main__":
    main()
