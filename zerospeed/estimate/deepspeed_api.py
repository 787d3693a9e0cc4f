"""DeepSpeed's estimator entry points, by their DeepSpeed names, printing the same per-option table.

`estimate_zero2_model_states_mem_needs_all_live(model, ...)` counts a live module;
`..._all_cold(total_params, ...)` takes the counts. Each prints "per CPU | per GPU | options" rows in
GiB (DeepSpeed labels them GB but divides by 2**30) and returns the rows as `EstimateRow`s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from zerospeed.estimate.census import census_of_module
from zerospeed.estimate.formulas import deepspeed_zero2_bytes, deepspeed_zero3_bytes

logger = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class EstimateRow:
    """One option's host (per node) and device (per GPU) bytes."""

    host_bytes: float
    device_bytes: float
    options: str


def zero2_rows(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1) -> list[EstimateRow]:
    """The ZeRO-2 table: optimizer offload on, then off."""
    return [
        EstimateRow(
            *deepspeed_zero2_bytes(total_params, num_gpus_per_node, num_nodes, off),
            f"offload_optimizer={'cpu ' if off else 'none'}",
        )
        for off in (True, False)
    ]


def zero3_rows(
    total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[EstimateRow]:
    """The ZeRO-3 table: (param, optimizer) offload cpu/cpu, none/cpu, none/none, each zero_init 1 then 0."""
    rows = []
    for off_param, off_optim in ((True, True), (False, True), (False, False)):
        for zero_init in (True, False):
            host, dev = deepspeed_zero3_bytes(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, off_optim, off_param, zero_init
            )
            rows.append(
                EstimateRow(
                    host,
                    dev,
                    f"offload_param={'cpu ' if off_param else 'none'}, "
                    f"offload_optimizer={'cpu ' if off_optim else 'none'}, "
                    f"zero_init={int(zero_init)}",
                )
            )
    return rows


def format_table(
    rows: list[EstimateRow],
    total_params: int,
    num_gpus_per_node: int,
    num_nodes: int,
    largest_layer_params: int | None = None,
) -> str:
    """The printed table, DeepSpeed's layout, numbers in GiB."""
    sw = f"{total_params / 1e6:.0f}M total params"
    if largest_layer_params is not None:
        sw += f", {largest_layer_params / 1e6:.0f}M largest layer params"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, {num_gpus_per_node} GPU"
        f"{'s' if num_gpus_per_node > 1 else ''} per node.",
        f"SW: Model with {sw}.",
        "   per CPU   |   per GPU  |   Options",
    ]
    lines += [f"  {r.host_bytes / GIB:7.2f}GiB | {r.device_bytes / GIB:6.2f}GiB | {r.options}" for r in rows]
    return "\n".join(lines)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[EstimateRow]:
    """Print and return the ZeRO-2 table for a model of `total_params` parameters."""
    rows = zero2_rows(total_params, num_gpus_per_node, num_nodes)
    print(format_table(rows, total_params, num_gpus_per_node, num_nodes))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[EstimateRow]:
    """Print and return the ZeRO-2 table for a live torch module."""
    return estimate_zero2_model_states_mem_needs_all_cold(
        census_of_module(model).total_params, num_gpus_per_node, num_nodes
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[EstimateRow]:
    """Print and return the ZeRO-3 table for the given parameter counts."""
    rows = zero3_rows(total_params, largest_layer_params, num_gpus_per_node, num_nodes)
    print(format_table(rows, total_params, num_gpus_per_node, num_nodes, largest_layer_params))
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[EstimateRow]:
    """Print and return the ZeRO-3 table for a live torch module."""
    c = census_of_module(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        c.total_params, c.largest_layer_params, num_gpus_per_node, num_nodes
    )
