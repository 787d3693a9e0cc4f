"""The module tensors of a checkpoint (parameters kept in the model states, buffers), full and canonical.

Without tensor parallelism they are `mp_rank_00_model_states.pt`'s "module" as saved. With it, each
tp rank's file holds the pieces that rank writes (Note [canonical tensors] in tensor_parallel.py);
tp rank 0 writes every name (it holds a piece of every sharded tensor, and the replicated ones), so
its keys are the checkpoint's, and a sharded tensor is assembled from the writer ranks' files, which
are opened (memory-mapped) only when a sharded tensor needs them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.manifest import saved_layouts
from zerospeed.checkpoint.naming import model_states_name
from zerospeed.checkpoint.tensor_parallel import Layouts, assemble_full, layout_problem, reslice, writer_ranks


class SavedModule:
    """`states`: the loaded mp_rank_00 model states (torch.load of MODEL_STATES)."""

    def __init__(self, tag_dir: Path, manifest: dict, states: dict):
        self.tag_dir, self.tied = Path(tag_dir), manifest.get("tied", {})
        self.layouts = saved_layouts(manifest)
        self._modules = {0: states["module"]}

    def keys(self) -> list[str]:
        return list(self._modules[0])

    def __contains__(self, key: str) -> bool:
        return key in self._modules[0]

    def _module(self, tp_rank: int) -> dict:
        if tp_rank not in self._modules:
            self._modules[tp_rank] = torch.load(
                self.tag_dir / model_states_name(tp_rank), map_location="cpu", mmap=True, weights_only=False
            )["module"]
        return self._modules[tp_rank]

    def full(self, key: str) -> torch.Tensor:
        """The canonical full tensor saved under `key` (a tied alias: its first name's)."""
        layout = self.layouts.get(self.tied.get(key, key))
        if layout is None:
            return self._modules[0][key]
        pieces = {}
        for r in writer_ranks(layout):
            module = self._module(r)
            if key not in module:
                raise CheckpointError(
                    f"checkpoint file {self.tag_dir / model_states_name(r)} lacks tp rank {r}'s "
                    f"piece of {key!r}; the checkpoint is incomplete — save it again"
                )
            pieces[r] = module[key]
        return assemble_full(pieces, layout)


def local_module_state(
    saved: SavedModule, *, layouts: Layouts, tp_rank: int, tp: int, tied: dict[str, str], skip: set[str]
) -> dict[str, torch.Tensor]:
    """The saved module tensors cut to this rank's tensor-parallel pieces (`layouts`: the loading model's;
    `tied`: its aliases), without the names in `skip`."""
    out = {}
    for key in saved.keys():
        if key in skip:
            continue
        full = saved.full(key)
        if not isinstance(full, torch.Tensor):  # a module's `_extra_state`: as saved
            out[key] = full
            continue
        name = tied.get(key, key)
        layout = layouts.get(name)
        if (problem := layout_problem(name, list(full.shape), layout, tp)) is not None:
            raise CheckpointError(
                f"checkpoint {saved.tag_dir}: {problem} (the tensor saved under {key!r} has full "
                f"shape {list(full.shape)}); build the model as it was when saved (the same model "
                "config and tensor_parallel.partition_config)"
            )
        out[key] = reslice(full, layout, tp_rank)
    return out
