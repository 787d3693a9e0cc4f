"""The estimator's plan: per-device and per-host bytes for every ZeRO option, and a recommendation.

`plan_rows` evaluates every `Option` (fastest first) with and without activation checkpointing;
`recommend` picks the first row whose device total fits the device memory (and host total, the host
memory when one is given). Activation rows need the transformer shape; without it they are 0.

With tensor / pipeline parallelism (`Setup.tp`, `Setup.pp`) the data-parallel size ZeRO shards over
is world / (tp x pp); every pipeline stage is evaluated (its tp rank 0's parameters, `layout.py`,
and its activations with the micro-batches 1F1B keeps in flight) and a row reports the stage with the
largest device total. `layout_rows` lists every valid (dp, tp, pp) of the world with its fastest fitting
option.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerospeed.estimate.census import ModelCensus
from zerospeed.estimate.formulas import OPTIONS, Option, Precision, placed_model_states, transformer_activation_bytes
from zerospeed.estimate.layout import (
    check_layout,
    in_flight,
    largest_module_params,
    stage_layers,
    stage_params,
    valid_tp,
)
from zerospeed.estimate.peak import EngineKnobs, Peak, Workload, peak_terms


@dataclass(frozen=True)
class Setup:
    """Hardware and run shape the plan is made for."""

    devices_per_node: int = 1
    nodes: int = 1
    precision: str = "fp16"
    optimizer: str = "adam"
    grad_dtype: str | None = None
    micro_batch: int = 1
    seq_len: int | None = None
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    micro_batches: int | None = None  # per step (gradient accumulation); bounds 1F1B's in-flight count
    backend: str = "nccl"  # the collectives' backend, for the peak's staging terms ("gloo" on CPUs)
    attention: str = "sdpa"  # "sdpa" (fused: no s x s scores kept) or "eager" (Korthikanti's 5*a*s/h term)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass(frozen=True)
class PlanRow:
    """One option: bytes per device and per host (node), by component."""

    option: Option
    checkpointing: bool
    device: dict[str, float]
    host_per_rank: dict[str, float]
    devices_per_node: int
    stage: int = 0  # the pipeline stage these numbers are for (the largest)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    peak: Peak | None = None  # the step's peak (zerospeed.estimate.peak), when the shape is known

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def device_need(self) -> float:
        """What the device must hold: the predicted peak where known, else model states + activations."""
        return self.peak.total if self.peak is not None else self.device_total

    @property
    def host_total(self) -> float:
        """Host bytes of the whole node: every local rank's offloaded shard."""
        return sum(self.host_per_rank.values()) * self.devices_per_node

    def label(self) -> str:
        return self.option.label() + (", activation checkpointing" if self.checkpointing else "")

    def layout_label(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}" + (f", pipeline stage {self.stage}" if self.pp > 1 else "")


def activation_bytes(census: ModelCensus, setup: Setup, checkpointing: bool, stage: int = 0) -> float:
    """Activation estimate for pipeline `stage` (all layers when pp = 1) on one rank, or 0 when the
    transformer shape is unknown."""
    seq = setup.seq_len or census.seq_len
    if not (census.layers and census.hidden and census.heads and seq):
        return 0.0
    layers = stage_layers(census.layers, setup.pp)[stage]
    return transformer_activation_bytes(
        layers=layers,
        hidden=census.hidden,
        heads=census.heads,
        seq_len=seq,
        micro_batch=setup.micro_batch,
        checkpointing=checkpointing,
        act_bytes=4 if setup.precision == "fp32" else 2,
        tp=setup.tp,
        sequence_parallel=setup.sequence_parallel,
        attention=setup.attention,
        micro_batches_in_flight=in_flight(stage, setup.pp, setup.micro_batches),
    )


def row_peak(census: ModelCensus, setup: Setup, option: Option, checkpointing: bool, dp: int) -> Peak | None:
    """The step's peak for a pure data-parallel run of a transformer whose shape and sequence length
    are known (None otherwise: the peak model covers tp = pp = 1). Gradients accumulate in fp32 unless
    --grad-dtype says otherwise, as the engine does (`data_types.grad_accum_dtype`)."""
    seq = setup.seq_len or census.seq_len
    if census.shape is None or not seq or setup.tp * setup.pp != 1 or census.shape.gated:
        return None
    prec = Precision.of(setup.precision, setup.optimizer, setup.grad_dtype or "fp32")
    act = 4 if setup.precision == "fp32" else 2
    # a model config is a transformers model's: its loss (ForCausalLMLoss) upcasts the logits to fp32
    return peak_terms(
        census.shape,
        dp,
        option,
        prec,
        Workload(setup.micro_batch, seq, checkpointing, attention=setup.attention, act_bytes=act, loss_upcast=True),
        EngineKnobs(
            collective_copies=1 if setup.backend == "gloo" else 0,
            host_is_device=setup.backend == "gloo",
            foreach_step=setup.backend != "gloo",
        ),
    )


def rank_params(census: ModelCensus, setup: Setup) -> tuple[list[int], int]:
    """(parameters on tp rank 0 of each pipeline stage, largest module there) for the setup's layout."""
    if setup.tp * setup.pp == 1:
        return [census.total_params], census.largest_layer_params
    return stage_params(census.shape, setup.tp, setup.pp), largest_module_params(census.shape, setup.tp)


def plan_rows(census: ModelCensus, setup: Setup) -> list[PlanRow]:
    """Every option x {no checkpointing, checkpointing}, fastest first; per row the largest stage."""
    dp = check_layout(
        census.shape,
        setup.world_size,
        setup.tp,
        setup.pp,
        seq_len=setup.seq_len or census.seq_len,
        sequence_parallel=setup.sequence_parallel,
    )
    prec = Precision.of(setup.precision, setup.optimizer, setup.grad_dtype)
    per_stage, largest = rank_params(census, setup)
    rows = []
    for option in OPTIONS:
        for ckpt in (False, True):
            candidates = []
            for stage, params in enumerate(per_stage):
                placed = placed_model_states(params, dp, option, prec, largest)
                device = dict(placed["device"], activations=activation_bytes(census, setup, ckpt, stage))
                candidates.append(
                    PlanRow(
                        option,
                        ckpt,
                        device,
                        placed["host"],
                        setup.devices_per_node,
                        stage,
                        setup.tp,
                        setup.pp,
                        dp,
                        peak=row_peak(census, setup, option, ckpt, dp),
                    )
                )
            rows.append(max(candidates, key=lambda r: (r.device_total, -r.stage)))
    return rows


def layout_rows(
    census: ModelCensus, setup: Setup, device_memory: float, host_memory: float | None = None
) -> list[tuple[Setup, PlanRow | None]]:
    """Every valid (tp, pp) for the setup's world, tp within a node (its all-reduces are per layer),
    with the fastest option that fits (None when nothing does); most data parallelism first."""
    out = []
    tps = valid_tp(census.shape, limit=setup.devices_per_node) if census.shape else [1]
    for tp in tps:
        for pp in range(1, (census.layers or 1) + 1):
            if setup.devices_per_node % tp or setup.world_size % (tp * pp):
                continue
            s = replace(setup, tp=tp, pp=pp)
            if s.sequence_parallel and (s.seq_len or census.seq_len or 0) % tp:
                continue
            out.append((s, recommend(plan_rows(census, s), device_memory, host_memory)))
    return sorted(out, key=lambda x: (-x[0].dp, x[0].tp, x[0].pp))


def speed_rank(row: PlanRow) -> tuple[int, bool, int]:
    """Sort key, fastest first: stages 0-2 move the same bytes per step (the ZeRO paper), so they form
    one tier tried without and then with checkpointing (~1/3 more compute); then stage 3 (1.5x the
    traffic), then optimizer offload, then parameter offload (host transfers every step)."""
    o = row.option
    tier = 3 if o.offload_param else 2 if o.offload_optimizer else 1 if o.stage == 3 else 0
    return tier, row.checkpointing, o.stage


def recommend(rows: list[PlanRow], device_memory: float, host_memory: float | None = None) -> PlanRow | None:
    """The fastest row (by `speed_rank`) whose device need (its predicted peak where known) fits the
    device memory (and host total, the host memory when given)."""
    for row in sorted(rows, key=speed_rank):
        if row.device_need <= device_memory and (host_memory is None or row.host_total <= host_memory):
            return row
    return None


def format_plan(rows: list[PlanRow], unit: float = 2**30, unit_name: str = "GiB") -> str:
    """A table: option | per-device params, grads, optimizer (masters + states), activations, total | host;
    with the peak (zerospeed.estimate.peak) where known: the peak and the term that dominates it."""
    peaks = any(r.peak is not None for r in rows)
    head = (
        f"{'option':<75} | {'params':>8} | {'grads':>8} | {'optim':>8} | {'activ':>8} | "
        f"{'device':>8} | {'host/node':>9}"
        + (f" | {'peak':>8} | {'dominant (phase)':<40}" if peaks else "")
        + f"   ({unit_name})"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r.device
        optim = d["master_weights"] + d["optimizer_states"]
        label = r.label() + (f" [pipeline stage {r.stage}]" if r.pp > 1 else "")
        lines.append(
            f"{label:<75} | {d['parameters'] / unit:8.2f} | {d['gradients'] / unit:8.2f} | "
            f"{optim / unit:8.2f} | {d['activations'] / unit:8.2f} | {r.device_total / unit:8.2f} | "
            f"{r.host_total / unit:9.2f}" + (_peak_cells(r, unit) if peaks else "")
        )
    return "\n".join(lines)


def _peak_cells(r: PlanRow, unit: float) -> str:
    if r.peak is None:
        return f" | {'-':>8} | {'-':<40}"
    return f" | {r.peak.total / unit:8.2f} | {f'{r.peak.dominant} ({r.peak.phase})':<40}"


def format_layouts(rows: list[tuple[Setup, PlanRow | None]], unit: float = 1e9, unit_name: str = "GB") -> str:
    """A table: dp x tp x pp | fastest option that fits | its device total on the largest stage."""
    head = f"{'dp x tp x pp':<14} | {'fastest option that fits':<75} | {'device':>8}   ({unit_name})"
    lines = [head, "-" * len(head)]
    for s, row in rows:
        layout = f"{s.dp} x {s.tp} x {s.pp}"
        if row is None:
            lines.append(f"{layout:<14} | {'nothing fits':<75} | {'-':>8}")
        else:
            label = row.label() + (f" [pipeline stage {row.stage}]" if row.pp > 1 else "")
            lines.append(f"{layout:<14} | {label:<75} | {row.device_total / unit:8.2f}")
    return "\n".join(lines)
