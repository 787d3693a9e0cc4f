"""Profiling: flops profiler, step timers, comm report, and the engine observer that runs the tools."""

from zerospeed.profiling.flops import count as count_flops
from zerospeed.profiling.model_profile import get_model_profile
from zerospeed.profiling.peak import current_device_peak, peak_flops_for
from zerospeed.profiling.profiler import FlopsProfiler, ModuleStats

__all__ = ["FlopsProfiler", "ModuleStats", "count_flops", "current_device_peak", "get_model_profile", "peak_flops_for"]
