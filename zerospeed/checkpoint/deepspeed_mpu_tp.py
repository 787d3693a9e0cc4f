"""DeepSpeed tags of a Megatron-DeepSpeed-style run (an `mpu`, the model's own column/row-parallel layers) loaded
into a data-parallel engine whose model is split the same way by its own code.

Note [DeepSpeed mpu tensor-parallel checkpoints]: `deepspeed.initialize(model=, mpu=)` with hand-written
tensor-parallel layers (no AutoTP) at tp T x dp D writes what Note [DeepSpeed tensor-parallel checkpoints]
(deepspeed_tp.py) describes — per tp rank t `mp_rank_{t:02d}_model_states.pt` of rank t's local tensors
(`mp_world_size` T, its mp rank is `mpu.get_model_parallel_rank()`) and at ZeRO 1/2 per (d, t)
`zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt` — and how the local tensors make the full ones is only known from
the `universal_checkpoint_info` the run saved (Megatron-DeepSpeed's model sets it; a client_state key lands in the
same file): deepspeed_tp.py joins the ranks by its name categories, so the tag loads as full tensors into the plain
model (tp 1, any dp), into zerospeed's tensor-parallel layers (their shard layouts cut them) and, here, into a
model split by its own code on a tp > 1 engine: every trainable parameter without a zerospeed shard layout takes its
piece by the same categories (`tp_piece`, the inverse of the join; Note [DeepSpeed pipeline checkpoints with tp]).
The same holds for DeepSpeed's universal folder of such a tag (full tensors; the info in its model-states files).
Such a model's split is invisible to zerospeed's own checkpoints, so saving it is refused (`check_replicated`).
"""

from __future__ import annotations

import math
from pathlib import Path

from zerospeed.checkpoint.deepspeed_import import MODEL, _load
from zerospeed.checkpoint.deepspeed_pipeline_tp import INFO, tp_piece
from zerospeed.checkpoint.errors import CheckpointError


def hand_split_names(ckpt, specs: dict, place) -> set[str]:
    """The parameters a tp > 1 engine holds split by the model's own code: no zerospeed shard layout and fewer
    elements than the checkpoint's full tensor (a replicated parameter holds them all); none at tp 1."""
    if place.tp == 1:
        return set()
    full = (ckpt.layout or {}).get("shapes") or {}
    return {
        n
        for n in specs
        if n not in place.layouts
        and n in ckpt.universal.tensors
        and n in full
        and math.prod(full[n]) != math.prod(specs[n]["shape"])
    }


def cut_hand_split(ckpt, specs: dict, place, tag_dir: Path) -> None:
    """Note [DeepSpeed mpu tensor-parallel checkpoints]: replace the full tensors (every state) of the parameters
    split by the model's own code by this tp rank's piece, cut by the tag's `universal_checkpoint_info`."""
    names = hand_split_names(ckpt, specs, place)
    if not names:
        return
    info = _load(Path(tag_dir) / MODEL).get(INFO) if (Path(tag_dir) / MODEL).exists() else None
    if not info:
        raise CheckpointError(
            f"{Path(tag_dir) / MODEL}: this engine runs tensor parallelism ({place.tp} ranks) with parameters split "
            f"by the model's own code (e.g. {sorted(names)[0]!r}), and the checkpoint records no "
            "universal_checkpoint_info saying how its tensors are split; save the DeepSpeed run with it (as "
            "Megatron-DeepSpeed does), or load it at tp 1 or into zerospeed.parallel.tensor's layers"
        )
    for name in sorted(names):
        shape = ckpt.layout["shapes"][name]
        states = ckpt.universal.tensors[name]
        for key, full in states.items():
            states[key] = tp_piece(info, name, full.reshape(shape), place.tp, place.tp_rank, Path(tag_dir)).reshape(-1)
