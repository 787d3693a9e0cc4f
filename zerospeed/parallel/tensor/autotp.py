"""AutoTP: shard a transformers model in place for tensor parallelism, without changing its code.

Every nn.Linear / transformers Conv1D of the model must be matched by a partition rule (plan.py):
column-parallel layers become `ColumnParallelLinear` (their outputs split, no gather), row-parallel
ones `RowParallelLinear` (inputs already split; one all-reduce), `skip` keeps a layer whole. A layer no
rule matches is an error naming it and the rule to add: a silently replicated layer would still be
correct but the user would not get the memory they asked for, and a silently split one would be wrong.

Note [attention heads under AutoTP]: a projection whose parent module has a `head_dim` is split by
whole heads. Its number of heads (out_features / head_dim) says whether it is a query projection
(num_attention_heads) or a key/value projection (num_key_value_heads): with grouped-query attention
and tp > kv heads, each rank gets the kv head its query heads read (partition.head_layout), replicated
instead of idling ranks. The attention module's own head counts (`num_heads`, `num_key_value_groups`,
GPT-2's `split_size`, ...) are then set to the local ones, because transformers reshapes with -1 and
reads only those attributes; `model.config` is left as it was (it describes the full model).

The input embedding becomes a `VocabParallelEmbedding`; the output head a column-parallel layer over
the same vocabulary split (sharing the embedding's shard when the weights are tied), and the model's
`loss_function` the vocabulary-parallel causal-LM loss, so `model(ids, labels=labels).loss` is the
plain model's loss while `.logits` holds this rank's vocabulary slice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerospeed.comm import backend
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.parallel.tensor import partition as P
from zerospeed.parallel.tensor.cross_entropy import VocabParallelCausalLMLoss
from zerospeed.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerospeed.parallel.tensor.load import load_shards, safetensors_files
from zerospeed.parallel.tensor.plan import Rule, first_match, resolve_rules

# Attention attributes transformers models read in forward, by what they count.
_Q_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")
_LOCAL_WIDTH_ATTRS = ("split_size", "embed_dim")  # GPT-2: the width of each of q, k, v in c_attn's output


@dataclass
class ShardReport:
    """What AutoTP did to each layer: {module name: "column" | "row" | "skip" | "vocab" | "vocab (tied)"},
    and the attention attributes it localised ({module name: {attr: local value}})."""

    layers: dict[str, str] = field(default_factory=dict)
    attention: dict[str, dict[str, int]] = field(default_factory=dict)


def is_linear_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _full_weight(module: nn.Module) -> tuple[torch.Tensor, bool]:
    """(weight in [out, in] layout, whether it was transposed from a Conv1D's [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), False
    return module.weight.detach().t(), True


def text_config_of(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _head_counts(config) -> tuple[int | None, int | None]:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv


def tp_plans_of(model: nn.Module) -> list[dict[str, str]]:
    plans = []
    config = text_config_of(model)
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None)):
        if plan:
            plans.append(dict(plan))
    return plans


class _Sharder:
    """One pass over a model: decide each layer's layout, replace it, localise attention attributes."""

    def __init__(self, model: nn.Module, group, rules: tuple[Rule, ...]):
        self.model, self.group, self.rules = model, group, rules
        self.tp, self.rank = backend.get_world_size(group), backend.get_rank(group)
        self.heads, self.kv_heads = _head_counts(text_config_of(model))
        self.report = ShardReport()

    def attention_layout(self, parent: nn.Module, name: str) -> P.HeadLayout | None:
        if getattr(parent, "head_dim", None) is None or self.heads is None:
            return None
        return P.head_layout(self.heads, self.kv_heads, self.tp, self.rank, what=f"attention {name!r}")

    def column_specs(self, name: str, parent: nn.Module, weight: torch.Tensor, rule: Rule) -> P.Specs:
        out = weight.shape[0]
        head_dim = getattr(parent, "head_dim", None) if self.heads else None
        if rule.shape:
            unit = head_dim if head_dim else 1
            sizes = P.fused_sizes(list(rule.shape), out)
            return tuple(
                P.fused_spec(sizes, self.tp, r, unit=unit, what=f"{name}.weight (fused, {rule.source})")
                for r in range(self.tp)
            )
        if head_dim and out % head_dim == 0 and out // head_dim in (self.heads, self.kv_heads):
            kv = out // head_dim == self.kv_heads and self.kv_heads != self.heads
            n = out // head_dim
            return tuple(
                P.heads_spec(
                    P.head_layout(self.heads, self.kv_heads, self.tp, r, f"attention of {name!r}"), head_dim, n, kv
                )
                for r in range(self.tp)
            )
        return tuple(P.column_spec(out, self.tp, r, f"out_features of {name}") for r in range(self.tp))

    def row_specs(self, name: str, parent: nn.Module, weight: torch.Tensor) -> P.Specs:
        inp = weight.shape[1]
        head_dim = getattr(parent, "head_dim", None) if self.heads else None
        if head_dim and inp == self.heads * head_dim:  # the attention output: split by query heads
            return tuple(
                P.heads_spec(
                    P.head_layout(self.heads, self.kv_heads, self.tp, r, f"attention of {name!r}"),
                    head_dim,
                    self.heads,
                    kv=False,
                    dim=1,
                )
                for r in range(self.tp)
            )
        return tuple(P.row_spec(inp, self.tp, r, f"in_features of {name}") for r in range(self.tp))

    def shard_linear(self, name: str, module: nn.Module, rule: Rule) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        if rule.kind == "skip":
            self.report.layers[name] = "skip"
            return
        weight, transposed = _full_weight(module)
        bias = module.bias.detach() if module.bias is not None else None
        if rule.kind == "column":
            new = ColumnParallelLinear.from_full(
                weight, bias, group=self.group, gather_output=False, specs=self.column_specs(name, parent, weight, rule)
            )
        else:
            new = RowParallelLinear.from_full(
                weight, bias, group=self.group, input_is_parallel=True, specs=self.row_specs(name, parent, weight)
            )
        new.source_transposed = transposed
        setattr(parent, child, new)
        self.report.layers[name] = rule.kind
        layout = self.attention_layout(parent, parent_name)
        if layout is not None and parent_name not in self.report.attention:
            self.localise_attention(parent_name, parent, layout)

    def localise_attention(self, name: str, attn: nn.Module, layout: P.HeadLayout) -> None:
        """Note [attention heads under AutoTP]."""
        changed = {}
        for attr in _Q_HEAD_ATTRS:
            if isinstance(getattr(attn, attr, None), int):
                changed[attr] = layout.q_heads
        for attr in _KV_HEAD_ATTRS:
            if isinstance(getattr(attn, attr, None), int):
                changed[attr] = layout.kv_heads
        if isinstance(getattr(attn, "num_key_value_groups", None), int):
            changed["num_key_value_groups"] = layout.kv_groups
        for attr in _LOCAL_WIDTH_ATTRS:
            if getattr(attn, attr, None) == self.heads * attn.head_dim:
                changed[attr] = layout.q_heads * attn.head_dim
        for attr, value in changed.items():
            setattr(attn, attr, value)
        self.report.attention[name] = changed


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None) if target is not None else None


def _shard_vocab(model: nn.Module, group, report: ShardReport) -> None:
    """Input embedding -> VocabParallelEmbedding; output head -> the same vocabulary split; the loss ->
    vocabulary-parallel. A tied head shares the embedding's shard (sharded once)."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(inp, nn.Embedding):
        return
    emb = VocabParallelEmbedding.from_embedding(inp, group=group)
    tied = out is not None and out.weight is inp.weight
    report.layers[_module_name(model, inp)] = "vocab"
    out_name = _module_name(model, out)
    model.set_input_embeddings(emb)
    if isinstance(out, nn.Linear):
        if tied:
            head = ColumnParallelLinear.tied_to(emb)
        else:
            tp = emb.tp_size
            if out.weight.shape[0] != emb.num_embeddings:
                raise ValueError(
                    f"output head {out_name!r} has {out.weight.shape[0]} rows but the input embedding "
                    f"{emb.num_embeddings}; AutoTP splits both by the same vocabulary ranges"
                )
            specs = tuple(P.vocab_spec(emb.num_embeddings, tp, r) for r in range(tp))
            head = ColumnParallelLinear.from_full(
                out.weight.detach(),
                None if out.bias is None else out.bias.detach(),
                group=group,
                specs=specs,
                gather_output=False,
            )
        model.set_output_embeddings(head)
        report.layers[out_name] = "vocab (tied)" if tied else "vocab"
        if hasattr(type(model), "loss_function"):
            model.loss_function = VocabParallelCausalLMLoss(group, emb.vocab_start)


def _suggest_rule(name: str) -> str:
    """A layer_specs rule (as JSON) matching `name` in every layer: layer indices become \\d+."""
    parts = [r"\d+" if part.isdigit() else re.escape(part) for part in name.split(".")]
    return json.dumps({"patterns": [r"^" + r"\.".join(parts) + r"\.weight$"], "partition_type": "skip"})


def shard_model(
    model: nn.Module,
    group,
    *,
    partition_config: Any = None,
    preset_model: str | None = None,
    vocab_parallel: bool = True,
) -> ShardReport:
    """Shard `model` in place over the tp `group` (every rank of it calls this with the same full model)."""
    config = text_config_of(model)
    model_type = getattr(config, "model_type", None)
    rules = resolve_rules(
        partition_config=partition_config, tp_plans=tp_plans_of(model), model_type=model_type, preset_model=preset_model
    )
    skip = {
        id(m)
        for m in (
            model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None,
            model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None,
        )
        if m is not None
    }
    linears = [(n, m) for n, m in model.named_modules() if is_linear_layer(m) and id(m) not in skip]
    matched = [(n, m, first_match(f"{n}.weight", rules)) for n, m in linears]
    missing = [n for n, _, rule in matched if rule is None]
    if missing:
        what = "no partition rules (no preset, no tp_plan, no partition_config)" if not rules else "no rule matches"
        raise ValueError(
            f"AutoTP cannot shard this {type(model).__name__} (model_type {model_type!r}): {what} for "
            f"{len(missing)} layer(s): {missing[:6]}{' ...' if len(missing) > 6 else ''}. Add "
            f"tensor_parallel.partition_config.layer_specs rules, e.g. {_suggest_rule(missing[0])} "
            "with partition_type column, row or skip"
        )
    sharder = _Sharder(model, group, rules)
    for name, module, rule in matched:
        sharder.shard_linear(name, module, rule)
    if vocab_parallel:
        _shard_vocab(model, group, sharder.report)
    return sharder.report


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    *,
    group=None,
    mesh=None,
    partition_config: Any = None,
    preset_model: str | None = None,
    vocab_parallel: bool = True,
    checkpoint: Any = None,
) -> nn.Module:
    """DeepSpeed's `tp_model_init(model, tp_size, dtype)`: cast (when `dtype` is given) and shard `model` in
    place over the tp group — `mesh.group("tp")`, or `group` — whose size must be `tp_size`.

    `checkpoint` (zerospeed's; DeepSpeed has none): a `save_pretrained` directory, a safetensors index,
    file or list of files to load the weights from after sharding, each rank reading only its slices
    (load.py). Meant for a model built on the meta device, which needs one."""
    if checkpoint is None and any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"tp_model_init: {type(model).__name__} is on the meta device and has no weights; pass "
            f"checkpoint=<save_pretrained directory or safetensors files>, e.g. "
            f"tp_model_init(model, {tp_size}, checkpoint=path), to load this rank's shards"
        )
    if group is None and mesh is None and backend.get_world_size() != tp_size:
        mesh = ParallelMesh.build(tp=tp_size)  # collective, as DeepSpeed's own tp group creation is
    if group is None and mesh is not None:
        group = mesh.group("tp")
    if backend.get_world_size(group) != tp_size:
        raise ValueError(f"tp_model_init(tp_size={tp_size}): the tp group has {backend.get_world_size(group)} ranks")
    files = None
    if checkpoint is not None:
        files = safetensors_files(checkpoint)  # before sharding: a bad path fails fast
    if dtype is not None:
        model.to(dtype)
    shard_model(
        model, group, partition_config=partition_config, preset_model=preset_model, vocab_parallel=vocab_parallel
    )
    if files is not None:
        load_shards(model, files)
    return model
