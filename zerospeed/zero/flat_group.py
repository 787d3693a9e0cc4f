"""One optimizer param group flattened into padded flat layouts, with this rank's chunk of each.

The model's parameters become views into the flat low-precision parameter buffers (so the
all-gather after a step writes them in place). fp32 masters exist only for this rank's chunks — in
fp32 training they *are* the chunk views of the parameter buffers, so nothing is duplicated.
"""

from __future__ import annotations

import torch

from zerospeed.zero.partition import FlatLayout, build_layouts


def flatten_fp32(layout: FlatLayout, values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The layout as one padded fp32 tensor holding `values` (in segment order) at their offsets."""
    full = torch.zeros(layout.padded, dtype=torch.float32, device=device)
    for s in layout.segments:
        full[s.offset : s.offset + s.numel].copy_(values[s.param].detach().reshape(-1))
    return full


class FlatParamGroup:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        hparams: dict,
        *,
        bucket_size: int,
        world_size: int,
        rank: int,
        param_dtype: torch.dtype,
        device: torch.device,
        plan=None,
        comm_dtypes: dict[int, torch.dtype] | None = None,
        master_dtype: torch.dtype = torch.float32,
    ):
        # Backward produces gradients roughly in reverse registration order: lay parameters out in
        # that order so the first layouts complete (and launch their reduction) first.
        self.params = list(reversed(params))
        self.hparams = hparams
        self.rank = rank
        # one gradient dtype per layout (Note [autocast gradient communication] in precision/autocast.py)
        kinds = [comm_dtypes.get(id(p)) for p in self.params] if comm_dtypes else None
        self.layouts: list[FlatLayout] = build_layouts(
            [p.numel() for p in self.params], bucket_size, world_size, kinds=kinds
        )
        self.param_buffers: list[torch.Tensor] = []
        self.masters: list[torch.nn.Parameter] = []
        # fp32 masters alias the parameter buffer when they live in the same memory; offloaded
        # masters are host copies (see zerospeed/offload/plan.py).
        master_device = plan.master_device if plan is not None else device
        alias = param_dtype == master_dtype and master_device == device  # (fp32, or Note [bf16 masters])
        alias = alias and not (plan is not None and plan.masters_apart)  # Note [delayed parameter update]
        for layout in self.layouts:
            full = flatten_fp32(layout, self.params, device)
            buffer = full if param_dtype == torch.float32 else full.to(param_dtype)
            lo, hi = layout.chunk_range(rank)
            if alias:
                master_src = buffer[lo:hi]
            elif master_device != device:
                master_src = plan.host_copy(full[lo:hi].to(master_dtype))
            else:
                master_src = full[lo:hi].to(master_dtype, copy=True)
            self.masters.append(torch.nn.Parameter(master_src))
            self.param_buffers.append(buffer)
            del full
        for layout, buffer in zip(self.layouts, self.param_buffers):
            for s in layout.segments:
                p = self.params[s.param]
                p.data = buffer[s.offset : s.offset + s.numel].view_as(p)

    def chunk(self, layout: FlatLayout, tensor: torch.Tensor) -> torch.Tensor:
        lo, hi = layout.chunk_range(self.rank)
        return tensor[lo:hi]

    @torch.no_grad()
    def write_master_to_param(self, i: int) -> None:
        """Copy layout i's updated fp32 master into this rank's chunk of its parameter buffer."""
        chunk = self.chunk(self.layouts[i], self.param_buffers[i])
        master = self.masters[i]
        if chunk.data_ptr() != master.data_ptr():
            chunk.copy_(master)
