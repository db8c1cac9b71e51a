"""DeepSpeed-style JSON config: loading, "auto" values, batch arithmetic and validation.

Everything here is pure: a bad value raises `ConfigError` (naming the key, the value and the fix)
before the engine touches a process group. The package's public surface is below; its modules:
core (Config, read_raw), sections (the typed sections and the names they check against),
resolve ("auto" values, parsing), deepspeed (DeepSpeed's names and features), scheduler_section.
"""

from .core import Config, read_raw
from .resolve import resolve_auto
from .scheduler_section import SCHEDULER_TYPES, validate_scheduler
from .sections import (
    AUTO,
    CHECKPOINT_POLICIES,
    SCHEDULES,
    ActivationCheckpointingConfig,
    BF16Config,
    FP16Config,
    IntOrInf,
    MonitorConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
    WandbConfig,
    ZeroConfig,
    ZerotronConfig,
    is_auto,
)

__all__ = [
    "Config",
    "read_raw",
    "resolve_auto",
    "SCHEDULER_TYPES",
    "validate_scheduler",
    "AUTO",
    "CHECKPOINT_POLICIES",
    "SCHEDULES",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "FP16Config",
    "IntOrInf",
    "MonitorConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "WandbConfig",
    "ZeroConfig",
    "ZerotronConfig",
    "is_auto",
]
