"""The config sections of the profiling tools, DeepSpeed's "flops_profiler" and "comms_logger" (the tools
themselves: zerotron/profiling and zerotron/comm/log.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class FlopsProfilerConfig:
    """DeepSpeed's "flops_profiler" section (zerotron/profiling): global rank 0 profiles the first forward of
    step `profile_step` and prints it when the step ends."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0  # extra forward passes per step (activation checkpointing), for FLOPS
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: Optional[str] = None


@dataclass
class CommsLoggerConfig:
    """DeepSpeed's "comms_logger" section (zerotron/comm/log.py): each collective's op, bytes and time,
    summarized by deepspeed.comm.log_summary()."""

    enabled: bool = False
    verbose: bool = False  # log every operation as it completes
    prof_all: bool = True  # every operation; else those named in prof_ops
    prof_ops: list = field(default_factory=list)
    debug: bool = False  # add the calling function to each record's name
