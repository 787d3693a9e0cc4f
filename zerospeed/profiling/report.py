"""Text report of a flops profile: totals, achieved FLOP/s and MFU, top modules per depth, module tree."""

from __future__ import annotations

from zerospeed.profiling.profiler import FlopsProfiler, ModuleStats


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (powers of 1000)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.4g} {unit}".rstrip()


def top_modules_by_depth(stats: list[ModuleStats], top: int) -> dict[int, list[ModuleStats]]:
    """For every depth, the `top` modules with the most MACs (ties: most params, then name)."""
    by_depth: dict[int, list[ModuleStats]] = {}
    for s in stats:
        by_depth.setdefault(s.depth, []).append(s)
    return {d: sorted(group, key=lambda s: (-s.macs, -s.params, s.name))[:top] for d, group in sorted(by_depth.items())}


def _line(s: ModuleStats, total_flops: int) -> str:
    share = 100 * s.flops / total_flops if total_flops else 0.0
    rate = s.flops / s.latency if s.latency else 0.0
    return (
        f"{'  ' * s.depth}{s.name} ({s.kind}): {human(s.params)} params, {human(s.macs)}MACs, "
        f"{human(s.flops)}FLOPs ({share:.2f}%), {s.latency * 1e3:.3f} ms, {human(rate)}FLOP/s"
    )


def _tensor_parallel_lines(prof: FlopsProfiler) -> list[str]:
    """The model's totals over the tp group (collective with a tp_group: every tp rank formats)."""
    flops, macs, params = prof.model_totals()
    return [
        f"tensor-parallel size:          {prof.tp_size} (numbers per rank are this rank's shards; "
        "'of model' sums the tp ranks, replicated work once)",
        f"params of model:               {human(params)}",
        f"forward MACs of model:         {human(macs)}MACs",
        f"forward FLOPs of model:        {human(flops)}FLOPs",
    ]


def format_profile(
    prof: FlopsProfiler,
    *,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    peak_flops: float | None = None,
    step: int | None = None,
    batch_size: int | None = None,
    recompute_fwd_factor: float = 0.0,
) -> str:
    """The whole report; `module_depth` -1 shows every depth in the tree."""
    flops, macs, secs = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_duration()
    rate = flops / secs if secs else 0.0
    per_rank = " per rank" if prof.tp_size > 1 else ""
    pad = " " * (24 - len(per_rank))
    lines = ["-------------------------- zerospeed flops profiler --------------------------"]
    if step is not None:
        lines.append(f"profile step:                  {step}")
    if batch_size is not None:
        lines.append(f"batch size per device:         {batch_size}")
    if prof.tp_size > 1:
        lines += _tensor_parallel_lines(prof)
    lines += [
        f"params{per_rank}:{pad}{human(prof.get_total_params())}",
        f"forward MACs{per_rank}:{pad[:-6]}{human(macs)}MACs",
        f"forward FLOPs{per_rank}:{pad[:-7]}{human(flops)}FLOPs",
        f"forward latency:               {secs * 1e3:.3f} ms",
        f"forward FLOP/s{per_rank}:{pad[:-8]}{human(rate)}FLOP/s",
        f"train step FLOPs{per_rank} (fwd + 2x bwd + {recompute_fwd_factor:g}x recompute): "
        f"{human((3 + recompute_fwd_factor) * flops)}FLOPs",
    ]
    if peak_flops:
        lines.append(f"MFU (forward, peak {human(peak_flops)}FLOP/s): {100 * rate / peak_flops:.2f}%")
    else:
        lines.append("MFU: unknown peak (pass peak_flops; CPUs and unlisted GPUs have no table entry)")
    stats = prof.module_stats()
    lines.append("top modules by MACs at each depth:")
    for depth, group in top_modules_by_depth(stats, top_modules).items():
        if module_depth == -1 or depth <= module_depth:
            lines.append(f"  depth {depth}: " + ", ".join(f"{s.name} {human(s.macs)}MACs" for s in group))
    if detailed:
        lines.append("per-module profile (inclusive of children" + (", this rank" if prof.tp_size > 1 else "") + "):")
        lines += [_line(s, flops) for s in stats if module_depth == -1 or s.depth <= module_depth]
    return "\n".join(lines)
