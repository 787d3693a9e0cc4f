"""`zerospeed-ckpt`: inspect a checkpoint, or consolidate it to one fp32 state dict.

    zerospeed-ckpt inspect DIR [--tag T] [--json] [--verify]
    zerospeed-ckpt to-fp32 DIR OUT [--tag T] [--max-shard-size 5GB] [--safe-serialization]
                                   [--exclude-frozen-parameters]
    zerospeed-ckpt export DIR OUT --to deepspeed --stage S --dp N [--tag T] [--output-tag T2]
                                  [--sub-group-size N] [--tp T] [--ep E]
    zerospeed-ckpt export DIR OUT --to universal [--dp N] [--tag T] [--output-tag T2]

`to-fp32` writes what DeepSpeed's `zero_to_fp32.py DIR OUT` writes: pytorch_model.bin by default,
model.safetensors with --safe-serialization; DeepSpeed's spellings of the options (--max_shard_size,
--safe_serialization, -t/--tag, --exclude_frozen_parameters) work too. `export --to deepspeed` writes
the checkpoint as DeepSpeed 0.19.8's tag for ZeRO stage S on N data-parallel ranks, with `latest`
(zerospeed.checkpoint.deepspeed_export): the real DeepSpeed's `engine.load_checkpoint(OUT)` resumes it;
with `--tp T` (a checkpoint saved with tensor parallelism) DeepSpeed's AutoTP tag for autotp_size T
(zerospeed.checkpoint.deepspeed_tp_export); a PipelineEngine checkpoint (ZeRO 0-2) becomes DeepSpeed's pipeline tag
for ZeRO S (0 or 1) with N data-parallel ranks per stage (zerospeed.checkpoint.deepspeed_pipeline; saved with tp
inside the stages, at the saved tp: zerospeed.checkpoint.deepspeed_pipeline_tp); a checkpoint
with MoE layers, DeepSpeed's MoE tag for expert-parallel size E (`--ep`, default 1; ZeRO 0-2;
zerospeed.checkpoint.deepspeed_experts); a checkpoint saved under AutoEP, DeepSpeed's AutoEP tag for autoep_size E
(`--ep`, default the saved one; ZeRO 0-3; zerospeed.checkpoint.deepspeed_autoep_export).
`export --to universal` writes DeepSpeed's universal folder and `latest_universal` (DeepSpeed, and zerospeed,
load it with `checkpoint.load_universal: true` at any stage; `--dp`: the most ZeRO-3 ranks it is named for); from a
PipelineEngine checkpoint (ZeRO 0-2; with tp inside the stages too), the folder `ds_to_universal` makes of
DeepSpeed's ZeRO-1 pipeline tag on N data-parallel ranks per stage, which DeepSpeed's and zerospeed's
PipelineEngine load.
"""

from __future__ import annotations

import argparse
import json
import sys
from math import prod

from zerospeed.checkpoint.consolidate import convert_zero_checkpoint_to_fp32_state_dict, resolve_checkpoint
from zerospeed.checkpoint.deepspeed_autoep_export import export_autoep_to_deepspeed, is_autoep_checkpoint
from zerospeed.checkpoint.deepspeed_experts import export_moe_to_deepspeed, has_experts
from zerospeed.checkpoint.deepspeed_export import export_to_deepspeed, export_universal
from zerospeed.checkpoint.deepspeed_pipeline import (
    export_pipeline_to_deepspeed,
    export_pipeline_universal,
    pipeline_tag_dir,
)
from zerospeed.checkpoint.deepspeed_pipeline_tp import (
    export_pipeline_tp_to_deepspeed,
    export_pipeline_universal_tp,
    saved_with_tp,
)
from zerospeed.checkpoint.deepspeed_tp_export import export_to_deepspeed_tp
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
    exp = sub.add_parser("export", help="write the checkpoint in another library's layout (DeepSpeed 0.19.8)")
    exp.add_argument("dir", help="checkpoint folder (holding `latest` and the tags), or one tag's directory")
    exp.add_argument("out", help="output folder: receives the tag directory and `latest`")
    exp.add_argument(
        "--to",
        choices=["deepspeed", "universal"],
        default="deepspeed",
        help="deepspeed: a DeepSpeed 0.19.8 tag for --stage/--dp; universal: DeepSpeed's universal folder "
        "(loads with checkpoint.load_universal at any stage and dp)",
    )
    exp.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage it will load at")
    exp.add_argument("--dp", type=int, default=None, help="data-parallel size it will load at (universal: at most)")
    exp.add_argument("-t", "--tag", default=None, help="tag to export (default: the one `latest` names)")
    exp.add_argument("--output-tag", default=None, help="tag name in OUT (default: the exported tag's)")
    exp.add_argument(
        "--sub-group-size", type=int, default=None, help="ZeRO-3 sub_group_size (default: the checkpoint's config)"
    )
    exp.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel size DeepSpeed will load a MoE checkpoint at (default 1): its layer_i_expert_e files, "
        "and expp_rank_* optimizer files at ZeRO 0; an AutoEP checkpoint: the autoep_size (default the saved one)",
    )
    exp.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size (autotp_size) DeepSpeed will load at: a checkpoint saved with tensor parallelism "
        "is written as DeepSpeed's AutoTP tag (mp_rank_XX files; ZeRO 0-2)",
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
        if args.command == "export" and args.to == "universal":
            common = {"dp": args.dp or 1, "tag": args.tag, "output_tag": args.output_tag}
            if saved_with_tp(args.dir, args.tag):  # Note [pipeline export with tp] (deepspeed_pipeline_tp.py)
                print(export_pipeline_universal_tp(args.dir, args.out, **common))
            elif pipeline_tag_dir(args.dir, args.tag) is not None:  # Note [DeepSpeed pipeline universal folders]
                print(export_pipeline_universal(args.dir, args.out, **common))
            else:
                print(export_universal(args.dir, args.out, **common))
            return 0
        if args.command == "export":
            if args.stage is None or args.dp is None:
                raise ValueError("export --to deepspeed needs --stage and --dp (the layout DeepSpeed will load at)")
            common = {"stage": args.stage, "dp": args.dp, "tag": args.tag, "output_tag": args.output_tag}
            if saved_with_tp(args.dir, args.tag):  # Note [pipeline export with tp] (deepspeed_pipeline_tp.py)
                tag_dir = export_pipeline_tp_to_deepspeed(args.dir, args.out, **common)
            elif pipeline_tag_dir(args.dir, args.tag) is not None:  # Note [pipeline export] (deepspeed_pipeline.py)
                tag_dir = export_pipeline_to_deepspeed(args.dir, args.out, **common)
            elif args.tp > 1:  # Note [DeepSpeed's AutoTP split] (deepspeed_tp_export.py)
                tag_dir = export_to_deepspeed_tp(args.dir, args.out, tp=args.tp, **common)
            elif is_autoep_checkpoint(args.dir, args.tag):  # Note [DeepSpeed AutoEP export]
                tag_dir = export_autoep_to_deepspeed(
                    args.dir, args.out, ep=args.ep, sub_group_size=args.sub_group_size, **common
                )
            elif has_experts(args.dir, args.tag):  # Note [DeepSpeed MoE checkpoints] (deepspeed_experts.py)
                tag_dir = export_moe_to_deepspeed(args.dir, args.out, ep=args.ep or 1, **common)
            else:
                tag_dir = export_to_deepspeed(args.dir, args.out, sub_group_size=args.sub_group_size, **common)
            print(tag_dir)
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
