"""`RandomLayerTokenDrop` (DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing.basic_layer`): one
transformer layer that, while training, sees only a random subset of the tokens (random-LTD, Yao et al.
2022, arXiv 2211.11586).

Note [random-LTD layer]: with the scheduler's reserved length r below the sequence length S, a
training forward keeps, for each sample, r token positions drawn uniformly without replacement and
sorted (so kept tokens keep their order), gathers their hidden states, runs the wrapped layer on
those [B, r, H] (or [r, B, H]) states and writes its outputs back at the kept positions; the S - r
dropped tokens skip the layer unchanged. The wrapped layer with id 0 (the first bound one, run first)
draws the positions of every random-LTD layer of this forward at once — `[layers, batch, r]` in the
scheduler's `state["sample_idx"]` — and layer k uses row k. The attention mask passed under
`model_mask_name` is cut to the kept tokens: for a decoder its leading [r, r] block (a causal mask's
block among any r sorted tokens is the same lower triangle; a padding mask is not followed, as in
DeepSpeed), for an encoder the rows and columns of this sample's kept positions. Gather and scatter
are plain `torch.gather` / `Tensor.scatter`, so autograd gives the exact gradient: the layer's
gradient at the kept positions, the incoming gradient unchanged at the dropped ones (DeepSpeed's
CUDA kernels compute the same). Evaluation, r >= S, and a layer the engine has not bound run the
wrapped layer on everything.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.data.random_ltd.scheduler import MAX_VALUE, SAMPLE_INDEX


class RandomLayerTokenDrop(nn.Module):
    """Wraps `layer`, called as `layer(hidden_states, **kwargs)` and returning a tensor or a tuple whose
    first element is the new hidden states. Inert until `init_config` binds it to a scheduler."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler = None
        self.max_length = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.batch_first = False

    def init_config(self, config: dict, scheduler, random_ltd_layer_id: int) -> None:
        """Bind to `scheduler` as the `random_ltd_layer_id`-th random-LTD layer; `config` is the
        `random_ltd` block (model_mask_name, micro_batch_size, hidden_state_order, model_type)."""
        order, kind = config["hidden_state_order"], config["model_type"]
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"random_ltd.hidden_state_order={order!r}: expected 'batch_seq_dim' or 'seq_batch_dim'")
        if kind not in ("decoder", "encoder"):
            raise ValueError(f"random_ltd.model_type={kind!r}: expected 'decoder' or 'encoder'")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state[MAX_VALUE]
        self.mask_name = config["model_mask_name"]
        self.micro_bs = config["micro_batch_size"]
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.model_type = kind
        self.batch_first = order == "batch_seq_dim"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if args:
            raise TypeError(
                f"{type(self.random_ltd_layer).__name__} wrapped for random-LTD got {len(args)} "
                "positional argument(s) after hidden_states: pass them by keyword (DeepSpeed's rule; "
                "the attention mask must arrive under random_ltd.model_mask_name)"
            )
        if self.random_ltd_scheduler is None:
            return self.random_ltd_layer(hidden_states, **kwargs)
        self.reserved_length = self.random_ltd_scheduler.get_current_seq()
        seq_dim = 1 if self.batch_first else 0
        self.curr_seq, self.curr_micro_batch = hidden_states.size(seq_dim), hidden_states.size(1 - seq_dim)
        if not self.training or self.reserved_length >= self.curr_seq:
            return self.random_ltd_layer(hidden_states, **kwargs)
        kept_BR = self._kept_positions(hidden_states.device)
        if kwargs.get(self.mask_name) is not None:
            kwargs[self.mask_name] = self._cut_mask(kwargs[self.mask_name], kept_BR)
        index = self._index(kept_BR, hidden_states)
        outputs = self.random_ltd_layer(hidden_states.gather(seq_dim, index), **kwargs)
        if isinstance(outputs, torch.Tensor):
            return hidden_states.scatter(seq_dim, index, outputs)
        if isinstance(outputs, tuple):
            return (hidden_states.scatter(seq_dim, index, outputs[0]), *outputs[1:])
        raise TypeError(
            f"random-LTD: {type(self.random_ltd_layer).__name__} returned {type(outputs).__name__}; "
            "a wrapped layer must return a tensor or a tuple whose first element is the hidden states"
        )

    def _kept_positions(self, device: torch.device) -> torch.Tensor:
        """This layer's kept positions, [batch, reserved_length] (Note [random-LTD layer])."""
        state = self.random_ltd_scheduler.state
        if self.random_ltd_layer_id == 0:
            layers, batch, seq = self.random_ltd_num_layer, self.curr_micro_batch, self.curr_seq
            drawn = torch.rand(layers * batch, seq, device=device).argsort(dim=1)[:, : self.reserved_length]
            state[SAMPLE_INDEX] = drawn.sort(dim=1).values.view(layers, batch, self.reserved_length)
        return state[SAMPLE_INDEX][self.random_ltd_layer_id]

    def _index(self, kept_BR: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """`kept_BR` as a gather / scatter index over the hidden states' layout."""
        kept = kept_BR if self.batch_first else kept_BR.t()
        trailing = hidden_states.shape[2:]
        return kept.reshape(*kept.shape, *(1,) * len(trailing)).expand(*kept.shape, *trailing)

    def _cut_mask(self, mask: torch.Tensor, kept_BR: torch.Tensor) -> torch.Tensor:
        """The mask's [..., query, key] entries of the kept tokens (a dimension of size 1 broadcasts)."""
        r = self.reserved_length
        if mask.dim() < 3:
            raise ValueError(
                f"random-LTD: the mask under {self.mask_name!r} has shape {tuple(mask.shape)}; expected "
                "[batch, ..., query, key] (DeepSpeed's [batch, 1, seq, seq])"
            )
        if self.model_type == "decoder":
            return mask[..., :r, :r]
        B = kept_BR.shape[0]
        mask = mask.expand(B, *mask.shape[1:])
        for dim in (mask.dim() - 2, mask.dim() - 1):
            if mask.size(dim) == 1:
                continue
            shape, sizes = [B] + [1] * (mask.dim() - 1), list(mask.shape)
            shape[dim] = sizes[dim] = r
            mask = mask.gather(dim, kept_BR.reshape(shape).expand(sizes))
        return mask
