"""The estimator's plan: per-device and per-host bytes for every ZeRO option, and a recommendation.

`plan_rows` evaluates every `Option` (fastest first) with and without activation checkpointing;
`recommend` picks the first row whose device total fits the device memory (and host total, the host
memory when one is given). Activation rows need the transformer shape; without it they are 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerospeed.estimate.census import ModelCensus
from zerospeed.estimate.formulas import OPTIONS, Option, Precision, placed_model_states, transformer_activation_bytes


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

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class PlanRow:
    """One option: bytes per device and per host (node), by component."""

    option: Option
    checkpointing: bool
    device: dict[str, float]
    host_per_rank: dict[str, float]
    devices_per_node: int

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        """Host bytes of the whole node: every local rank's offloaded shard."""
        return sum(self.host_per_rank.values()) * self.devices_per_node

    def label(self) -> str:
        return self.option.label() + (", activation checkpointing" if self.checkpointing else "")


def activation_bytes(census: ModelCensus, setup: Setup, checkpointing: bool) -> float:
    """Activation estimate for one micro-batch, or 0 when the transformer shape is unknown."""
    seq = setup.seq_len or census.seq_len
    if not (census.layers and census.hidden and census.heads and seq):
        return 0.0
    return transformer_activation_bytes(layers=census.layers, hidden=census.hidden, heads=census.heads,
                                        seq_len=seq, micro_batch=setup.micro_batch, checkpointing=checkpointing,
                                        act_bytes=4 if setup.precision == "fp32" else 2)


def plan_rows(census: ModelCensus, setup: Setup) -> list[PlanRow]:
    """Every option x {no checkpointing, checkpointing}, fastest first."""
    prec = Precision.of(setup.precision, setup.optimizer, setup.grad_dtype)
    rows = []
    for option in OPTIONS:
        placed = placed_model_states(census.total_params, setup.world_size, option, prec,
                                     census.largest_layer_params)
        for ckpt in (False, True):
            device = dict(placed["device"], activations=activation_bytes(census, setup, ckpt))
            rows.append(PlanRow(option, ckpt, device, placed["host"], setup.devices_per_node))
    return rows


def speed_rank(row: PlanRow) -> tuple[int, bool, int]:
    """Sort key, fastest first: stages 0-2 move the same bytes per step (the ZeRO paper), so they form
    one tier tried without and then with checkpointing (~1/3 more compute); then stage 3 (1.5x the
    traffic), then optimizer offload, then parameter offload (host transfers every step)."""
    o = row.option
    tier = 3 if o.offload_param else 2 if o.offload_optimizer else 1 if o.stage == 3 else 0
    return tier, row.checkpointing, o.stage


def recommend(rows: list[PlanRow], device_memory: float, host_memory: float | None = None) -> PlanRow | None:
    """The fastest row (by `speed_rank`) that fits the device memory (and host memory when given)."""
    for row in sorted(rows, key=speed_rank):
        if row.device_total <= device_memory and (host_memory is None or row.host_total <= host_memory):
            return row
    return None


def format_plan(rows: list[PlanRow], unit: float = 2**30, unit_name: str = "GiB") -> str:
    """A table: option | per-device params, grads, optimizer (masters + states), activations, total | host."""
    head = (f"{'option':<75} | {'params':>8} | {'grads':>8} | {'optim':>8} | {'activ':>8} | "
            f"{'device':>8} | {'host/node':>9}   ({unit_name})")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r.device
        optim = d["master_weights"] + d["optimizer_states"]
        lines.append(f"{r.label():<75} | {d['parameters'] / unit:8.2f} | {d['gradients'] / unit:8.2f} | "
                     f"{optim / unit:8.2f} | {d['activations'] / unit:8.2f} | {r.device_total / unit:8.2f} | "
                     f"{r.host_total / unit:9.2f}")
    return "\n".join(lines)
