"""`zerospeed-ckpt`: inspect a checkpoint, or consolidate it to one fp32 state dict.

    zerospeed-ckpt inspect DIR [--tag T] [--json] [--verify]
    zerospeed-ckpt to-fp32 DIR OUT [--tag T] [--max-shard-size 5GB] [--safe-serialization]
                                   [--exclude-frozen-parameters]

`to-fp32` writes what DeepSpeed's `zero_to_fp32.py DIR OUT` writes: pytorch_model.bin by default,
model.safetensors with --safe-serialization; DeepSpeed's spellings of the options (--max_shard_size,
--safe_serialization, -t/--tag, --exclude_frozen_parameters) work too.
"""

from __future__ import annotations

import argparse
import json
import sys
from math import prod

from zerospeed.checkpoint.consolidate import convert_zero_checkpoint_to_fp32_state_dict, resolve_checkpoint
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.manifest import verify_files


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerospeed-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print a checkpoint's manifest")
    ins.add_argument("dir", help="checkpoint folder (holding `latest` and the tags), or one tag's directory")
    ins.add_argument("--tag", default=None, help="tag to inspect (default: the one `latest` names)")
    ins.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    ins.add_argument("--verify", action="store_true", help="also check every file's size and sha256")
    conv = sub.add_parser("to-fp32", help="write the consolidated fp32 weights (pytorch_model.bin by default)")
    conv.add_argument("dir", help="checkpoint folder")
    conv.add_argument("out", help="output folder")
    conv.add_argument("-t", "--tag", default=None, help="tag to convert (default: the one `latest` names)")
    conv.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        dest="max_shard_size",
        default="5GB",
        help="largest output file, e.g. 5GB, 500MB (default 5GB)",
    )
    conv.add_argument(
        "--safe-serialization",
        "--safe_serialization",
        dest="safe_serialization",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="write model.safetensors instead of pytorch_model.bin (torch.save), as DeepSpeed's flag",
    )
    conv.add_argument(
        "--exclude-frozen-parameters",
        "--exclude_frozen_parameters",
        dest="exclude_frozen_parameters",
        action="store_true",
        help="leave frozen parameters out",
    )
    return parser


def _tensor_parallel(manifest: dict) -> str:
    layout = manifest.get("parallel_layout", {})
    tp, sp = layout.get("tensor_parallel", 1), layout.get("sequence_parallel", 1)
    out = f"tensor parallel {tp} ({len(layout.get('shard_specs', {}))} sharded parameters), " if tp > 1 else ""
    return out + (f"sequence parallel {sp} (counted in data parallel), " if sp > 1 else "")


def summary(tag_dir, manifest: dict) -> str:
    """A human-readable account of a manifest."""
    params = manifest["parameters"]
    trainable = sum(prod(s["shape"]) for s in params.values() if s["trainable"])
    frozen = sum(prod(s["shape"]) for s in params.values() if not s["trainable"])
    lines = [
        f"checkpoint        {tag_dir}",
        f"tag               {manifest['tag']}",
        f"zerospeed         {manifest['zerospeed_version']} (torch {manifest['torch_version']})",
        f"layout            ZeRO stage {manifest['zero_stage']}, data parallel {manifest['dp_world_size']}, "
        f"{_tensor_parallel(manifest)}world {manifest['world_size']}, params {manifest['param_dtype']}",
        f"progress          step {manifest['global_steps']}, {manifest['global_samples']} samples",
        f"optimizer         {manifest['optimizer']['type']} ({manifest['optimizer']['param_groups']} groups)",
        f"parameters        {len(params)} tensors: {trainable:,} trainable, {frozen:,} frozen elements",
    ]
    if manifest["tied"]:
        lines.append("tied              " + ", ".join(f"{a} -> {n}" for a, n in manifest["tied"].items()))
    lines.append("files")
    for name, rec in manifest["files"].items():
        lines.append(f"  {name:48s} {rec['bytes']:>12,} B  sha256 {rec['sha256'][:16]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            tag_dir, manifest = resolve_checkpoint(args.dir, args.tag)
            print(json.dumps(manifest, indent=1) if args.json else summary(tag_dir, manifest))
            if args.verify:
                problem = verify_files(tag_dir, manifest, list(manifest["files"]))
                if problem is not None:
                    raise CheckpointError(problem)
                print(f"verified {len(manifest['files'])} files")
            return 0
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.dir,
            args.out,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
        for path in written:
            print(path)
        return 0
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"zerospeed-ckpt: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
