"""`get_model_profile`: profile one forward pass of a model outside training (DeepSpeed's name)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from zerospeed.profiling.peak import current_device_peak
from zerospeed.profiling.profiler import NO_GROUP, FlopsProfiler
from zerospeed.profiling.report import format_profile, human

logger = logging.getLogger(__name__)


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args=(),
    kwargs=None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules=(),
    peak_flops: float | None = None,
    tp_group=NO_GROUP,
    tp_size: int | None = None,
):
    """Run `model(*args, **kwargs)` (or on a random `input_shape` tensor) and return (flops, macs, params).

    `warm_up` unprofiled passes run first. The numbers are strings like '1.23 GFLOPs' unless
    `as_string` is False. The report goes to `output_file`, else stdout, when `print_profile`.
    `peak_flops` (FLOP/s) sets the MFU reference; default: the device table, none on CPU.
    Tensor parallelism: the returned numbers are this rank's (its shards); the report adds the model's
    totals over `tp_group` (None: the world group; every rank of it must call this, with the same
    print_profile) or, without a group, `tp_size` ranks doing the same work (`FlopsProfiler`).
    """
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args:
            raise ValueError("get_model_profile: give input_shape or args, not both")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        args = (torch.ones(input_shape, device=device),)
    prof = FlopsProfiler(model, ignore_modules=tuple(ignore_modules), tp_group=tp_group, tp_size=tp_size)
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        prof.start_profile()
        try:
            model(*args, **kwargs)
        finally:
            prof.stop_profile()
    if print_profile:
        text = format_profile(
            prof,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            peak_flops=peak_flops or current_device_peak(),
        )
        if output_file:
            Path(output_file).write_text(text + "\n")
        else:
            print(text)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.end_profile()
    if as_string:
        return human(flops, "FLOPs"), human(macs, "MACs"), human(params)
    return flops, macs, params
