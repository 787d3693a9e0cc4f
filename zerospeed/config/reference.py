"""The config reference: every key of ``ZeroSpeedConfig`` with its type, default, meaning and status.

The reference is *generated* from the pydantic schema (``zerospeed/config/schema/``), the
not-yet-implemented table (``zerospeed.config.features.ROWS``) and the ``NO_EFFECT`` table below,
so the document cannot drift from the code: ``scripts/gen_config_reference.py`` writes
``docs/config_reference.md`` and a unit test fails when the checked-in file is stale.

Types are read from the validators that ``zerospeed.config.schema.base`` builds (their closure
variables hold the bounds, choices and nullability). A validator this module does not know is an
error naming the key, so a new field type cannot be documented wrongly by accident.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from zerospeed.config.auto import LITERAL_AUTO_KEYS, auto_values_from_hidden_size
from zerospeed.config.features import DEEPSPEED_REFUSED, ROWS, Row, refusal_reason
from zerospeed.config.schema.root import BATCH_KEYS, ZeroSpeedConfig

COMMAND = "python scripts/gen_config_reference.py"
REFERENCE_PATH = "docs/config_reference.md"

WORKS = "works"
NOT_YET = "not yet"
NO_EFFECT_STATUS = "accepted, no effect"
REFUSED = "refused (DeepSpeed too)"

# Keys that parse, are not errors, and change nothing in zerospeed -- with the reason. Either
# the layout always gives what the key asks for, or the key tunes a mechanism zerospeed does not
# have (a CUDA kernel, a DeepSpeed-internal code path), so there is nothing for it to change.
# Keys that *request* a missing feature belong in ``features.ROWS`` instead (an error, never
# silence). Dotted keys; a section's key covers every key under it.
NO_EFFECT: dict[str, str] = {
    "zero_optimization.zenflow.pt_reserved_cores_perc": (
        "ZenFlow's host step runs on a thread of the training process (DeepSpeed pins a separate process to "
        "its own cores); torch's intra-op threads are shared"
    ),
    "weight_quantization.num_bits": "each layer's bits come from quantized_initialization / post_init_quant, as in "
    "DeepSpeed's group-wise weight quantization",
    "weight_quantization.q_type": "symmetry comes from quantized_initialization / post_init_quant (symmetric)",
    "weight_quantization.q_groups": "groups come from quantized_initialization / post_init_quant (group_size)",
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel": (
        "there is no CUDA quantizer kernel; the PyTorch quantizer computes the same thing"
    ),
    "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward": (
        "weights are always fake-quantized in forward"
    ),
    "compression_training.weight_quantization.shared_parameters.quantize_verbose": "bit changes are not logged",
    "compression_training.weight_quantization.shared_parameters.fp16_mixed_quantize.quantize_change_ratio": (
        "fp16 mixed quantization is refused"
    ),
    **{
        f"compression_training.sparse_pruning.shared_parameters.{name}": (
            "only the refused snip_momentum method reads it"
        )
        for name in (
            "schedule_offset_end",
            "schedule_offset_stride",
            "block_pattern",
            "dense_ratio",
            "excluded_modules",
        )
    },
    **{
        f"hybrid_engine.{name}": "it configures DeepSpeed's inference-kernel workspace; the hybrid engine generates "
        "with the model's own forward"
        for name in ("max_out_tokens", "release_inference_cache", "tp_gather_partition_size", "enable_cuda_graph")
    },
    "disable_allgather": "DeepSpeed 0.19.8 parses it and never reads it; updated partitions are always all-gathered",
    "vocabulary_size": "DeepSpeed only warns when it is not a multiple of 8; zerospeed does not check it",
    "bf16.immediate_grad_update": "bf16 gradients are accumulated in fp32 and applied at the step either way",
    "zero_optimization.contiguous_gradients": "stage-2 gradient chunks are always contiguous",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter gradients; stage 0 always all-reduces",
    "zero_optimization.use_multi_rank_bucket_allreduce": "stages 1-3 always reduce-scatter, never all-reduce buckets",
    "zero_optimization.allgather_partitions": "updated partitions are always all-gathered, in buckets",
    "zero_optimization.load_from_fp32_weights": "fp32 masters are always restored from the checkpoint's fp32 copy",
    "zero_optimization.elastic_checkpoint": "checkpoints always load at any world size (resharded on load)",
    "checkpoint.writer.io_buffer_double": "the background writer already overlaps writing with training",
    "checkpoint.writer.data_parallel": "every rank writes only its own shard; replicated state is written once",
    "checkpoint.writer.io_multiplier": "each rank writes its files with one thread",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "save_16bit_model always gathers stage-3 weights unit by unit onto rank 0"
    ),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "stage-3 parameters are always fetched by all-gather",
    "zero_optimization.stage3_allgather_sequential": "stage-3 all-gathers are always coalesced per fetch",
    "zero_optimization.legacy_stage1": "there is one stage-1 implementation",
    "zero_optimization.round_robin_gradients": (
        "it orders gradient copies for CPU offload; the partitioned layout already splits them evenly"
    ),
    "zero_optimization.zeropp_loco_param": "LoCo-ZeRO++ is not built; the value is ignored",
    "zero_optimization.memory_efficient_linear": (
        "zerospeed never replaces torch.nn.functional.linear: a released stage-3 weight frees its storage "
        "even where autograd saved it (docs/zero.md, the linear wrapper)"
    ),
    "zero_optimization.pipeline_loading_checkpoint": "pipeline parallelism runs with ZeRO 0-2 (stage 3 is refused)",
    "zero_optimization.override_module_apply": "zerospeed never overrides nn.Module.apply",
    "zero_optimization.log_trace_cache_warnings": (
        "the recorded stage-3 fetch order has no warning switch (Note [stage-3 prefetch order])"
    ),
    "zero_optimization.enable_sanity_checks": "there is no separate sanity-check mode",
    "zero_optimization.compute_grad_norm": (
        "the global gradient norm is always computed at the step (clipping and overflow checks need it)"
    ),
    "zero_optimization.parameter_alignment": "flat buffers are always padded to 16-byte chunks",
    "zero_optimization.save_muon_momentum_buffer_in_memory": (
        "Muon's momentum is always in memory; Muon with NVMe optimizer offload is refused"
    ),
    "zero_optimization.offload_param.max_in_cpu": "NVMe parameter shards are never cached in host memory beyond "
    "the buffer pool (docs/offload.md)",
    "zero_optimization.offload_optimizer.fast_init": "initialisation has no slow path to skip (docs/offload.md)",
    "zero_optimization.offload_optimizer.buffer_count": "the NVMe optimizer swapper sizes its buffer pool from "
    "pipeline_read / pipeline_write (docs/offload.md)",
    "pipeline.pipe_partitioned": (
        "with tensor parallelism inside stages every tp rank sends its whole activation; they are "
        "not split over tp ranks"
    ),
    "pipeline.grad_partitioned": (
        "with tensor parallelism inside stages every tp rank sends its whole gradient; they are not split over tp ranks"
    ),
    "seq_parallel_communication_data_type": "gradients of a sequence-parallel model reduce over "
    "data x sequence ranks in one collective, in communication_data_type; the attention all-to-alls travel in the "
    "activations' own dtype",
    "tensor_parallel.tp_overlap_comm": "the tensor-parallel all-reduces run in order on the compute stream",
    "tensor_parallel.vocab_parallel_lm_head": "AutoTP always shards the embedding and the output head over the "
    "vocabulary (a tied pair once)",
    "tensor_parallel.dtype": "the model's dtype comes from fp16 / bf16; AutoTP shards whatever dtype the model has",
    "tensor_parallel.keep_module_on_host": "the model is sharded where it lives; there is no load-time placement",
    "tensor_parallel.tp.tp_size": "inference-style setting; training takes the degree from autotp_size",
    "tensor_parallel.tp.tp_grain_size": "inference-style setting; splits are by whole heads and even columns",
    "aio.io_backend": "I/O always goes through zerospeed's thread-pool file I/O (zerospeed/offload/aio.py)",
    "timers.throughput": "samples/s is always measured for the progress line and monitors",
    **{
        f"autotuning.model_info.{name}": "only DeepSpeed's bucket-size tuning space (fast: false) reads it; "
        "zerospeed's autotuner tunes no bucket sizes by default (docs/autotuning.md)"
        for name in ("hidden_size", "num_layers")
    },
    "elasticity.min_time": "a hint for a resource scheduler (minutes to run before rescaling); the runtime, as "
    "DeepSpeed's, only checks it is >= 0",
    "checkpoint.checkpoint_serialization": "checkpoints are always written with torch.save's default format",
    **{
        f"expert_parallel.{name}": "AutoEP's experts run one matmul pair per local expert and move tokens by the comm "
        "gateway's all-to-all (docs/moe.md); there is no grouped-GEMM kernel, DeepEP buffer or "
        "split-plan stream to tune"
        for name in (
            "use_grouped_mm",
            "disable_triton_grouped_mm",
            "async_split_plan",
            "combine_impl",
            "comm_num_sm",
            "comm_qp_margin",
            "comm_max_tokens_per_rank",
        )
    },
    **{
        key: "DeepSpeed switches random-LTD by data_efficiency.data_routing.random_ltd.enabled alone (and the "
        "curriculum data sampler by data_sampling.curriculum_learning.enabled alone); zerospeed too, warning when "
        "random-LTD is on and this is false"
        for key in ("data_efficiency.enabled", "data_efficiency.data_routing.enabled")
    },
    "data_efficiency.data_sampling.enabled": "DeepSpeed's engine builds the curriculum sampler on "
    "data_sampling.curriculum_learning.enabled alone (its only sampling technique); so does zerospeed",
    "data_efficiency.data_sampling.dynamic_batching": "DeepSpeed's engine never reads it (only its separate helper "
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed does, which zerospeed does not provide)",
    **{
        f"data_efficiency.data_routing.random_ltd.{key}": f"the engine sets it to {value}, as DeepSpeed's does"
        for key, value in (
            ("micro_batch_size", "train_micro_batch_size_per_gpu"),
            ("global_batch_size", "train_batch_size"),
        )
    },
    "expert_parallel.validate_folding_routing": "expert groups always split the data-parallel ranks (no folding onto "
    "tensor-parallel ranks), so there is no folded routing to validate",
}

# Keys that only configure a feature a features.ROWS row switches on: while that row exists the
# feature is off, so they have nothing to configure. ``block or key -> the switching ROWS key``.
# Derived at render time, so removing the row (the feature lands) makes them ``works``.
GATES: dict[str, str] = {
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": "zero_optimization.offload_optimizer.super_offload",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "zero_optimization.offload_optimizer.super_offload",
    "amp": "amp.enabled",
    "torch_autocast": "torch_autocast.enabled",
    "hybrid_engine": "hybrid_engine.enabled",
    **{
        f"compile.{name}": "compile.deepcompile"
        for name in (
            "autoep_non_moe",
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_activation_pin_memory",
            "offload_opt_states",
            "double_buffer",
            "symmetric_memory",
            "debug_log",
            "offload_parameters",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
            "passes",
        )
    },
    "nebula": "nebula.enabled",
    "curriculum_learning": "curriculum_learning.enabled",
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule": (
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled"
    ),
    "progressive_layer_drop": "progressive_layer_drop.enabled",
    "eigenvalue": "eigenvalue.enabled",
    "quantize_training": "quantize_training.enabled",
}

# Keys refused outside features.ROWS (by the code that would use them): key -> (feature, where).
REFUSED_ELSEWHERE: dict[str, tuple[str, str]] = {
    "compression_training.weight_quantization.shared_parameters.fp16_mixed_quantize.enabled": (
        "fp16 mixed quantization",
        "true is a ConfigError from zerospeed/compression/compress.py",
    ),
    "compression_training.sparse_pruning.shared_parameters.method": (
        'the "snip_momentum" method',
        '"snip_momentum" is a ConfigError from zerospeed/compression/compress.py; "l1" and "topk" work',
    ),
    "use_data_before_expert_parallelism": (
        "the data-major expert layout",
        "true is a ConfigError from zerospeed/moe/autoep.py",
    ),
    **{
        f"expert_parallel.{name}": (
            what,
            "a value other than the default is a ConfigError from zerospeed/moe/autoep.py",
        )
        for name, what in (
            ("expert_tensor_parallel_size", "expert tensor parallelism"),
            ("comm_backend", "the DeepEP all-to-all backend"),
            ("load_balance_coeff", "auxiliary-loss-free load balancing"),
            ("num_expert_groups", "group-limited routing"),
            ("num_limited_groups", "group-limited routing"),
            ("route_scale", "scaling router scores"),
            ("routed_scaling_factor", "scaling routed expert outputs"),
            ("expert_w3", "separate gate / up expert weights"),
        )
    },
    **{
        f"expert_parallel.{name}": (
            "routing other than the model's own",
            "AutoEP keeps the model's router: a value that differs from what it does is a "
            "ConfigError from zerospeed/moe/autoep.py",
        )
        for name in ("route_norm", "score_func", "score_apply", "top_k")
    },
    "torch_autocast.dtype": (
        "autocast to fp32",
        '"fp32" is a ConfigError from zerospeed/precision/autocast.py; "bf16" and "fp16" work',
    ),
    "hybrid_engine.inference_tp_size": (
        "tensor-sliced generation in the hybrid engine",
        "a value above 1 is a ConfigError from zerospeed/runtime/hybrid_engine.py",
    ),
    "comms_logger.debug": (
        "naming the calling function of each collective",
        "true with comms_logger.enabled is a ConfigError from zerospeed/profiling/observer.py",
    ),
}

# "auto" sources other than LITERAL_AUTO_KEYS (see zerospeed/config/auto.py and initialize).
_HIDDEN_SIZE_AUTO = frozenset(auto_values_from_hidden_size(1))


@dataclass(frozen=True)
class KeyDoc:
    """One row of the reference: a dotted key (``[]`` marks a list of objects) and its facts."""

    key: str
    type: str
    default: str
    description: str
    status: str
    section: bool = False


@dataclass(frozen=True)
class SectionDoc:
    """One config block: its dotted path (``""`` = top level), summary and rows in schema order."""

    path: str
    summary: str
    rows: tuple[KeyDoc, ...]


# --- schema walking ---------------------------------------------------------------------------


def _ordered_fields(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """Fields in the order they are written: bases left to right, then the class's own.

    pydantic lists the fields of a multiply-inherited model (``ZeroSpeedConfig``) in MRO order,
    i.e. the last base first; the reference follows the source instead.
    """
    names: list[str] = []
    for base in (*model.__bases__, model):
        if isinstance(base, type) and issubclass(base, BaseModel) and base is not BaseModel:
            names += [name for name in base.model_fields if name not in names]
    return [(name, model.model_fields[name]) for name in names]


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(annotation, False)``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The nested model a field holds directly (``X``, ``X | None``) or as ``list[X]``."""
    inner, _ = _strip_none(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return inner, False
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None, False


def _child_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def iter_sections(model: type[BaseModel] = ZeroSpeedConfig, path: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """Every config block depth-first in schema order: ``(dotted path, model)``; lists end in ``[]``."""
    yield path, model
    for name, field in _ordered_fields(model):
        child, is_list = _model_of(field.annotation)
        if child is not None:
            yield from iter_sections(child, _child_path(path, name) + ("[]" if is_list else ""))


def leaf_keys(model: type[BaseModel] = ZeroSpeedConfig) -> list[str]:
    """Dotted keys of every field that is not itself a config block, in schema order."""
    return [
        _child_path(path, name)
        for path, block in iter_sections(model)
        for name, field in _ordered_fields(block)
        if _model_of(field.annotation)[0] is None
    ]


# --- types ----------------------------------------------------------------------------------


def _validator(field_or_metadata: Any) -> Any:
    """The function of the single ``BeforeValidator`` in pydantic metadata, or None."""
    funcs = [getattr(m, "func", None) for m in field_or_metadata]
    funcs = [f for f in funcs if f is not None]
    return funcs[0] if funcs else None


def _num(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds(base: str, minimum: Any, maximum: Any, exclusive: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return f"{base} in [{_num(minimum)}, {_num(maximum)}]"
    if minimum is not None:
        return f"{base} {'>' if exclusive else '>='} {_num(minimum)}"
    if maximum is not None:
        return f"{base} <= {_num(maximum)}"
    return base


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _choices(table: dict[Any, Any]) -> str:
    """``one of {...}`` from a ``choice_type`` table; spellings other than a value's lower case follow."""
    values = list(dict.fromkeys(table.values()))
    extra = [k for k, v in table.items() if k != (v.lower() if isinstance(v, str) else v)]
    text = "one of {" + ", ".join(_json(v) for v in values) + "}"
    if extra:
        text += " (also " + ", ".join(_json(k) for k in extra) + ")"
    return text


def _from_validator(key: str, func: Any, annotation: Any) -> tuple[str, bool]:
    """Human-readable type and nullability of a field built by ``schema.base`` (or its neighbours)."""
    env = inspect.getclosurevars(func).nonlocals
    code = func.__code__.co_names
    nullable = bool(env.get("nullable", False))
    if "_coerce_int" in code:
        return _bounds("int", env["minimum"], env["maximum"]), nullable
    if "_coerce_float" in code:
        return _bounds("float", env["minimum"], env["maximum"], env["exclusive"]), nullable
    if "_coerce_bool" in code:
        return "bool", nullable
    if "_coerce_str" in code:
        return "str", nullable
    if "_coerce_choice" in code:
        return _choices(env["table"]), nullable
    if "_coerce_dict" in code:
        return "object", nullable
    if "_coerce_list" in code:
        inner, _ = _strip_none(annotation)
        item = typing.get_args(inner)[0].__name__
        single = f" (or one {item})" if env["single_ok"] else ""
        return f"list[{item}]{single}", nullable
    if func.__name__ == "_coerce_json":
        return "any JSON value", False
    if func.__name__ == "_auto_or_count":
        return '"auto" or int >= 1', False
    if func.__name__ == "check" and env.get("kind") in ("int", "num"):
        return '"auto" or ' + ("int >= 1" if env["kind"] == "int" else "float"), False
    raise TypeError(
        f"{key}: zerospeed/config/reference.py does not know the field type built by "
        f"{func.__qualname__}; teach _from_validator about it"
    )


def _annotated_type(key: str, annotation: Any) -> tuple[str, bool]:
    """Type of a plain annotation: ``list[<choice>]`` and similar shapes built without a validator."""
    inner, nullable = _strip_none(annotation)
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        func = _validator(getattr(item, "__metadata__", ()))
        if func is not None:
            return f"list[{_from_validator(key, func, item)[0]}]", nullable
        return f"list[{getattr(item, '__name__', item)}]", nullable
    names = {bool: "bool", int: "int", float: "float", str: "str", dict: "object"}
    if inner in names:
        return names[inner], nullable
    if typing.get_origin(inner) is dict:  # named entries of one model, e.g. compression's different_groups
        _, value = typing.get_args(inner)
        if isinstance(value, type) and issubclass(value, BaseModel):
            keys = ", ".join(name for name, _ in _ordered_fields(value))
            return f"object of name -> {{{keys}}}", nullable
    raise TypeError(
        f"{key}: zerospeed/config/reference.py cannot describe the type {annotation!r}; teach _annotated_type about it"
    )


def _auto_note(key: str) -> str:
    if key in LITERAL_AUTO_KEYS:
        return ""  # "auto" is already one of the values the type names
    if key in BATCH_KEYS:
        return '; "auto" allowed (derived by the batch-size rules)'
    if key in _HIDDEN_SIZE_AUTO:
        return '; "auto" allowed (filled from the model\'s hidden size)'
    return ""


def field_type(key: str, field: FieldInfo) -> str:
    """``int >= 0``, ``one of {...}``, ``list[str]``, ``object`` ..., with ``or null`` and ``"auto"`` notes."""
    model, is_list = _model_of(field.annotation)
    if model is not None:
        text, nullable = ("list[object]" if is_list else "object"), _strip_none(field.annotation)[1]
    else:
        func = _validator(field.metadata)
        text, nullable = (
            _from_validator(key, func, field.annotation) if func is not None else _annotated_type(key, field.annotation)
        )
    if nullable:
        text += " or null"
    return text + _auto_note(key)


# --- defaults and descriptions ----------------------------------------------------------------


def field_default(field: FieldInfo) -> str:
    """The default as JSON; a block that defaults to its all-default model shows ``{}``."""
    if field.default_factory is not None:
        value = field.default_factory()
        return "{}" if isinstance(value, BaseModel) else _json(value)
    return _json(field.default)


_DEFAULT_SENTENCE = re.compile(r"\s*\bDefaults? (?:\S+ )*?(?:is|are) DeepSpeed's\.$|\s*\bDefault \{\}[^.]*\.$")


def field_description(field: FieldInfo) -> str:
    """The field's description without the trailing default sentence (the table has a default column)."""
    return _DEFAULT_SENTENCE.sub("", field.description or "").strip()


# --- status -----------------------------------------------------------------------------------


def _covers(prefix: str, key: str) -> bool:
    return key == prefix or key.startswith(prefix + ".") or key.startswith(prefix + "[]")


def _feature_name(row: Row) -> str:
    return row.feature if isinstance(row.feature, str) else row.key


def key_status(key: str) -> str:
    """``not yet: <feature> ...`` when a features.ROWS row names the key or a parent (or the code
    that would use it refuses it), else ``accepted, no effect (why)`` from ``NO_EFFECT`` or an open
    ``GATES`` row, else ``works``."""
    rows = [row for row in ROWS if _covers(row.key, key)]
    if rows:
        return "; ".join(
            f"{NOT_YET}: {_feature_name(row)} (allowed: {row.default})"
            if row.key == key
            else f"{NOT_YET}: {_feature_name(row)} (see {row.key})"
            for row in rows
        )
    gone = [row for row in DEEPSPEED_REFUSED if _covers(row.key, key)]
    if gone:  # features.DEEPSPEED_REFUSED: keys DeepSpeed 0.19.8 refuses itself
        row = gone[0]
        allowed = f"allowed: {row.default}" if row.key == key else f"see {row.key}"
        return f"{REFUSED}: {_feature_name(row)} was {refusal_reason(row)} ({allowed})"
    if key in REFUSED_ELSEWHERE:
        feature, where = REFUSED_ELSEWHERE[key]
        return f"{NOT_YET}: {feature} ({where})"
    reasons = [why for prefix, why in NO_EFFECT.items() if _covers(prefix, key)]
    if reasons:
        return f"{NO_EFFECT_STATUS} ({reasons[0]})"
    gates = [(prefix, gate) for prefix, gate in GATES.items() if _covers(prefix, key) and key != gate]
    for _prefix, gate in gates:
        row = next((r for r in ROWS if r.key == gate), None)
        if row is not None:
            return f"{NO_EFFECT_STATUS} (configures {_feature_name(row)}, not built yet: see {gate})"
        row = next((r for r in DEEPSPEED_REFUSED if r.key == gate), None)
        if row is not None:
            return f"{NO_EFFECT_STATUS} (configures {_feature_name(row)}, which DeepSpeed refuses too: see {gate})"
    return WORKS


# --- rendering --------------------------------------------------------------------------------


def _anchor(path: str) -> str:
    """GitHub's heading anchor for ``## `path```: lower case, punctuation other than - and _ dropped."""
    return re.sub(r"[^a-z0-9_\- ]", "", f"`{path}`".lower()).replace(" ", "-")


def _row(path: str, name: str, field: FieldInfo) -> KeyDoc:
    key = _child_path(path, name)
    model, is_list = _model_of(field.annotation)
    status = key_status(key)
    if model is not None:
        target = key + ("[]" if is_list else "")
        link = f"block: see [{target}](#{_anchor(target)})"
        status = link if status == WORKS else f"{status}; {link}"
    return KeyDoc(
        key, field_type(key, field), field_default(field), field_description(field), status, section=model is not None
    )


def _summary(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    return doc.split("\n\n")[0].replace("\n", " ").replace("``", "`")


def sections() -> list[SectionDoc]:
    """Every config block with its rows, in schema order."""
    return [
        SectionDoc(path, _summary(model), tuple(_row(path, name, f) for name, f in _ordered_fields(model)))
        for path, model in iter_sections()
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(section: SectionDoc) -> list[str]:
    lines = ["| key | type | default | description | status |", "|---|---|---|---|---|"]
    for row in section.rows:
        cells = [f"`{row.key}`", row.type, f"`{row.default}`", row.description, row.status]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


_HEADER = f"""\
# Config reference

<!-- Generated by `{COMMAND}` from zerospeed/config/schema/, zerospeed/config/features.py and
zerospeed/config/reference.py. Do not edit by hand: change those and run the command again.
tests/unit/test_config_reference.py fails when this file is stale. -->

Every key of DeepSpeed's JSON config that zerospeed parses, one section per config block, in
schema order. Defaults are DeepSpeed's (see docs/config.md for the few that differ between
DeepSpeed versions). Unknown keys are errors that name the nearest valid key.

Status:
- **works**: read and honoured by zerospeed.
- **not yet: <feature>**: parses, but asking for it (any value other than the one named) stops
  `initialize` with a `ConfigError` naming the key (the table in zerospeed/config/features.py).
- **accepted, no effect (why)**: parses and is allowed, but changes nothing in zerospeed, for the
  reason given.

Types: `int >= 0` and `float in [0, 1]` give the accepted range; whole-number floats such as
`2e8` are accepted for `int`. `one of {{...}}` values are case-insensitive. `"auto"` is accepted
where the type says so; elsewhere `"auto"` with nothing to fill it is an error naming the key.
"""


def render_reference() -> str:
    """The whole of docs/config_reference.md (deterministic: schema order, no timestamps)."""
    out = [_HEADER]
    for section in sections():
        title = section.path or "top level"
        out += [f"## `{title}`", "", section.summary, ""] + _table(section) + [""]
    return "\n".join(out)


__all__ = [
    "COMMAND",
    "GATES",
    "KeyDoc",
    "NO_EFFECT",
    "REFUSED_ELSEWHERE",
    "REFERENCE_PATH",
    "SectionDoc",
    "field_default",
    "field_description",
    "field_type",
    "iter_sections",
    "key_status",
    "leaf_keys",
    "render_reference",
    "sections",
]
