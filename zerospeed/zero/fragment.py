"""Where one trainable parameter's fp32 training state lives on this rank — what DeepSpeed's
`deepspeed.utils.safe_get_full_fp32_param` & co. (zerospeed/zero/tensor_access.py) read and write.

Note [parameter fragments]: DeepSpeed finds a parameter's state through attributes it sets on the
parameter (`param._hp_mapping`, `param.ds_tensor`). Here only a weak reference is: building a
strategy *claims* its trainable parameters in their tags (Note [parameter tags], zero/tags.py; a
dropped engine or model leaves nothing behind; the newest claim wins), and the owning strategy
describes a parameter on request as a `ParamFragment`: views of this rank's piece of its fp32 master,
of its current gradient and (by key) of its optimizer state, plus the ranks the pieces are spread
over. A rank's piece of a flattened parameter is always one contiguous range, possibly empty: a
parameter is laid whole into one flat layout, and a rank's chunk of a layout is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerospeed import comm
from zerospeed.zero import tags


def claim(params, strategy) -> None:
    """Record `strategy` as the owner of `params` (Note [parameter fragments])."""
    tags.set_trainer(params, strategy)


def owner_of(param: torch.Tensor):
    """The live strategy that trains `param`, or None (frozen, or not under an engine)."""
    return tags.trainer_of(param)


@dataclass(frozen=True)
class Held:
    """Elements [start, start + numel) of a flattened parameter, kept at [offset, offset + numel) of
    the flattened `tensor`. `ranks` (a zero.strategy.ReductionGroup) are the ranks whose pieces make
    up the whole parameter; None when this rank holds all of it (nothing to exchange)."""

    tensor: torch.Tensor
    offset: int
    start: int
    numel: int
    ranks: object = None

    def view(self) -> torch.Tensor:
        """The piece, 1-D, sharing memory with `tensor` (read it where `tensor` currently lives)."""
        return self.tensor.view(-1)[self.offset : self.offset + self.numel]

    def on(self, tensor: torch.Tensor) -> Held:
        """The same elements of another tensor laid out like this one (an optimizer state)."""
        return Held(tensor, self.offset, self.start, self.numel, self.ranks)


@dataclass(frozen=True)
class ParamFragment:
    """One parameter on this rank: its full shape, where the model computes (`device`), its fp32
    master piece (`master.tensor` is the optimizer's parameter, the key of its state), and its
    gradient as the next step would use it (None: no gradient since the last step)."""

    shape: torch.Size
    device: torch.device
    master: Held
    grad: Held | None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def assemble(held: Held, frag: ParamFragment) -> torch.Tensor:
    """The whole value (fp32, the parameter's shape, a new tensor on `frag.device`) from every rank's
    piece: one all-reduce of a zero-filled buffer over `held.ranks` — the pieces are disjoint, so the
    sum is exact — as DeepSpeed's stage 1-2 accessors do. Without `ranks`, a copy of the piece."""
    if held.ranks is None:
        return held.view().to(frag.device, torch.float32, copy=True).view(frag.shape)
    out = torch.zeros(frag.numel, dtype=torch.float32, device=frag.device)
    out[held.start : held.start + held.numel].copy_(held.view())
    comm.all_reduce(out, op="sum", group=held.ranks.group)
    return out.view(frag.shape)
