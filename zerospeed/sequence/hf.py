"""Ulysses for transformers models, without changing their code: DeepSpeed's `UlyssesSPAttentionHF`.

`UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size, micro_batch_size)`
builds the mesh's sequence axis and puts a Ulysses wrapper in transformers' attention registry
(`ALL_ATTENTION_FUNCTIONS`, the interface transformers offers for custom attention) under the model's
own implementation name, so every branch transformers takes for that implementation still runs; the
wrapper acts only on the registered model's attention modules and hands everything else to the
original function. It returns the `mpu` to pass to `initialize` (DeepSpeed's contract).

The model sees sequence-sharded hidden states (`shard_sequence_batch` / `UlyssesSPDataLoaderAdapter`
give each rank its slice and the global `position_ids`, so rotary embeddings are right); inside each
attention call the wrapper trades sequence for heads, runs the original attention on the whole
sequence (causal, no mask: Note [padding is exact] in `data.py`) and trades back.
`install_sequence_parallel_loss(model, group)` makes `model(...).loss` the exact mean over the whole
sequence on every rank (Note [sequence-parallel loss]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.sequence.layer import heads_to_sequence, sequence_to_heads
from zerospeed.sequence.layout import HeadPlan
from zerospeed.sequence.loss import sequence_parallel_cross_entropy
from zerospeed.sequence.tiled import tiled_mlp
from zerospeed.zero.leaf_modules import set_z3_leaf_module

_UNSUPPORTED = ("eager", "paged|eager")


class _LocalHeads:
    """The attention module as the original attention function should see it after the exchange: the
    same module, but with this rank's query-per-kv grouping (what GQA repeats by)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "num_key_value_groups", num_key_value_groups)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_module"), name)


def _gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    """[b, s/P] -> [b, s] (the global position ids, for attention kernels that read them)."""
    world = comm.get_world_size(group)
    out = t.new_empty((world, *t.shape))
    comm.all_gather_into_tensor(out, t.contiguous(), group=group)
    return torch.cat(out.unbind(0), dim=-1)


class UlyssesSPAttentionHF(torch.nn.Module):
    """The Ulysses wrapper around one transformers attention function (`attn`), with DeepSpeed's
    constructor arguments. Shapes: transformers passes q/k/v as [b, heads, s/P, d] and expects
    ([b, s/P, heads, d], weights) back."""

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn, self.process_group = attn, process_group
        self.world_size, self.sp_rank = comm.get_world_size(process_group), comm.get_rank(process_group)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = (
            attn_head_count,
            attn_head_size,
            kv_head_count,
        )
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.plan = HeadPlan.of(attn_head_count, kv_head_count, self.world_size)

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if not self.seq_length_is_variable and self.local_seq_length not in (None, query.shape[2]):
            raise ValueError(
                f"UlyssesSPAttentionHF: got a local sequence of {query.shape[2]} tokens but was registered "
                f"with seq_length={self.global_seq_length} (local {self.local_seq_length}); register with "
                "seq_length_is_variable=True for batches of varying length"
            )
        group, plan = self.process_group, self.plan
        q = sequence_to_heads(query, group, plan.q, seq_dim=2, head_dim=1)  # [b, n_q, s, d]
        k = sequence_to_heads(key, group, plan.kv, seq_dim=2, head_dim=1)
        v = sequence_to_heads(value, group, plan.kv, seq_dim=2, head_dim=1)
        if torch.is_tensor(kwargs.get("position_ids")):
            kwargs["position_ids"] = _gather_sequence(kwargs["position_ids"], group)
        local = _LocalHeads(module, plan.kv_groups(self.sp_rank))
        out, weights = self.attn(local, q, k, v, None, *args, **kwargs)  # out: [b, s, n_q, d]
        return heads_to_sequence(out, group, plan.q, seq_dim=1, head_dim=2), weights

    # -- registration ---------------------------------------------------------------------------------
    _active: dict[str, tuple[Any, Any]] = {}
    """implementation name -> (original function, wrapper): what unregister restores."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
        mesh: ParallelMesh | None = None,
    ):
        """Route `core_attn_implementation` through Ulysses for this model; returns the mpu (None at sp 1).

        `model_name_or_path`: the model (its attention modules are the ones wrapped) or a name/path whose
        config gives the head counts (then every attention call with that config's shapes is wrapped).
        `mesh` (zerospeed's own): a mesh with a sequence axis of this size to use instead of building one.
        """
        if sequence_parallel_size == 1:
            return None
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: pass seq_length=<tokens per sequence> or seq_length_is_variable=True"
            )
        model_config = (
            model_name_or_path.config
            if hasattr(model_name_or_path, "config")
            else AutoConfig.from_pretrained(model_name_or_path)
        )
        chosen = getattr(model_config, "_attn_implementation", None)
        if chosen is not None and chosen != core_attn_implementation:
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} but the model runs "
                f"attn_implementation={chosen!r}; load the model with attn_implementation="
                f"{core_attn_implementation!r} (or pass {chosen!r} here)"
            )
        if core_attn_implementation in _UNSUPPORTED:
            raise ValueError(
                f"attn_implementation={core_attn_implementation!r} builds its causal structure from a "
                "[s, s] mask, which a sequence shard cannot give it; load the model with "
                "attn_implementation='sdpa' (or a flash / flex attention)"
            )
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{core_attn_implementation!r} is not a transformers attention implementation; "
                f"choose one of {list(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
            )
        if core_attn_implementation in cls._active:
            raise RuntimeError(
                f"Ulysses is already registered for {core_attn_implementation!r} in this process; "
                "call UlyssesSPAttentionHF.unregister_from_transformers() first"
            )
        text = model_config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        mesh = mesh if mesh is not None else ParallelMesh.build(sp=sequence_parallel_size)
        if mesh.size("sp") != sequence_parallel_size:
            raise ValueError(f"the mesh given has a sequence axis of {mesh.size('sp')}, not {sequence_parallel_size}")
        group = mesh.group("sp")
        HeadPlan.of(heads, kv_heads, sequence_parallel_size)  # every head-count problem, before anything changes
        local = None if seq_length_is_variable else -(-seq_length // sequence_parallel_size)
        original = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        uattn = cls(
            original,
            micro_batch_size,
            heads,
            head_dim,
            kv_heads,
            text.num_hidden_layers,
            group,
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=local,
            global_seq_length=seq_length,
            disable_in_eval=disable_in_eval,
        )
        owned = _attention_modules(model_name_or_path, text)

        def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            mine = id(module) in owned if owned is not None else (query.shape[1] == heads and key.shape[1] == kv_heads)
            if not mine:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = wrapper
        cls._active[core_attn_implementation] = (original, wrapper)
        return mesh.as_mpu()

    @classmethod
    def unregister_from_transformers(cls, core_attn_implementation: str | None = None) -> None:
        """Put the original attention functions back (all of them, or the one named)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        names = [core_attn_implementation] if core_attn_implementation is not None else list(cls._active)
        for name in names:
            if name not in cls._active:
                raise ValueError(f"Ulysses is not registered for {name!r}; registered: {sorted(cls._active)}")
            original, wrapper = cls._active.pop(name)
            if ALL_ATTENTION_FUNCTIONS.get(name) is wrapper:
                ALL_ATTENTION_FUNCTIONS[name] = original


def _attention_modules(model, text_config) -> set[int] | None:
    """ids of the model's attention modules (those with the text config and q/k/v projections or an
    attention-like name); None when only a name/path was given."""
    if not isinstance(model, torch.nn.Module):
        return None
    found = set()
    for module in model.modules():
        name = type(module).__name__.lower()
        projections = all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj"))
        if getattr(module, "config", None) is text_config and (
            projections or "attention" in name or name.endswith("attn")
        ):
            found.add(id(module))
    if not found:
        raise ValueError(
            f"register_with_transformers: found no attention module in {type(model).__name__} (modules "
            "with q_proj/k_proj/v_proj, or named *Attention*); pass the model whose attention runs"
        )
    return found


def install_sequence_parallel_loss(model, group, ignore_index: int = -100) -> None:
    """Make `model(..., labels=..., shift_labels=...)`'s loss the exact mean over the whole sequence on
    every rank (Note [sequence-parallel loss]); the shift_labels come from `shard_sequence_batch`. Given
    the Trainer's `num_items_in_batch`, the loss is this rank's sum over that count instead (the Trainer
    scales and averages it)."""

    def loss_function(
        logits,
        labels=None,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index=ignore_index,
        shift_labels=None,
        **kwargs,
    ):
        if shift_labels is None:
            raise ValueError(
                "sequence parallelism: the batch has no 'shift_labels' (labels shifted on the full "
                "sequence before sharding); feed the model through zerospeed.sequence.data."
                "shard_sequence_batch or UlyssesSPDataLoaderAdapter"
            )
        if num_items_in_batch is None:
            return sequence_parallel_cross_entropy(logits, shift_labels, group, ignore_index=ignore_index)
        # the Trainer's contract (Note [Trainer sequence parallelism] in integrations/hf_trainer.py): this
        # rank's token-loss sum over the tokens of the whole accumulated batch, counted over every rank
        flat = logits.reshape(-1, logits.shape[-1]).float()
        local = F.cross_entropy(
            flat, shift_labels.reshape(-1).to(flat.device), ignore_index=ignore_index, reduction="sum"
        )
        return local / torch.as_tensor(num_items_in_batch, device=local.device, dtype=local.dtype)

    model.loss_function = loss_function


def enable_tiled_mlp(model: torch.nn.Module, shards: int) -> int:
    """ALST's tiled MLP for a transformers model: every MLP block (a module whose class name ends in
    "MLP" and holds parameters) computes over `shards` tiles of its tokens (`zerospeed.sequence.tiled`),
    so its [tokens, intermediate] activations exist one tile at a time. The module's own forward is kept
    and called per tile (names and weights are untouched); returns the number of blocks tiled. Each
    tiled block is also flagged a ZeRO-3 leaf module (Note [tiled compute under ZeRO-3] in
    sequence/tiled.py): call it before `zerospeed.initialize`."""
    count = 0
    for module in model.modules():
        if not type(module).__name__.endswith("MLP") or not any(True for _ in module.parameters()):
            continue
        own = module.forward
        inner = _OwnForward(own, module)
        module.forward = lambda x, inner=inner, shards=shards: tiled_mlp(inner, x, shards)  # instance attribute
        set_z3_leaf_module(module, True)
        count += 1
    if count == 0:
        raise ValueError(f"enable_tiled_mlp: {type(model).__name__} has no module whose class name ends in 'MLP'")
    return count


class _OwnForward:
    """The MLP's original forward as a callable with the module's parameters (what tiled_mlp reads)."""

    def __init__(self, forward, module):
        self.forward, self.module = forward, module

    def __call__(self, x):
        return self.forward(x)

    def parameters(self):
        return self.module.parameters()
