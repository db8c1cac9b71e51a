"""Profiling: the flops profiler (flops.py; DeepSpeed's `deepspeed.profiling.flops_profiler`), its
printed report (report.py), and the engine's hook that runs it at the config's `profile_step` (engine_hook.py)."""

from . import flops as flops_profiler  # DeepSpeed's name for it (`deepspeed.profiling.flops_profiler.FlopsProfiler`)
from .flops import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile", "flops_profiler"]
