"""ZeRO model-state memory and per-step communication per rank, measured vs predicted.

    python benchmarks/zero_memory.py [--worlds 1 2 4]

Memory is an independent census of live tensor storages (harness.census), taken after two
optimizer steps of AdamW on a 5.24M-parameter MLP, minus the census before the model was built.
Traffic is the comm gateway's counters for the second step (2 micro-steps of accumulation).
"""

from __future__ import annotations

import argparse

from harness import run_distributed
from harness.zero_probe import probe_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print(
        "| N | precision | stage | params | predicted MB/rank | measured MB/rank (census) | measured/predicted "
        "| wire MB/step/rank | by kind (MB payload) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for world in args.worlds:
        rank0 = run_distributed(probe_all, world, timeout=600)[0]
        for r in rank0:
            wire = sum(v["wire_bytes"] for v in r["traffic"].values()) / 1e6
            kinds = ", ".join(f"{k} {v['payload_bytes'] / 1e6:.2f}" for k, v in sorted(r["traffic"].items()))
            print(
                f"| {world} | {r['precision']} | {r['stage']} | {r['params']:,} | {r['predicted'] / 1e6:.2f} "
                f"| {r['measured'] / 1e6:.2f} | {r['measured'] / r['predicted']:.4f} | {wire:.2f} | {kinds or '-'} |"
            )


if __name__ == "__main__":
    main()
