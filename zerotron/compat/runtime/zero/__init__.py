"""`deepspeed.runtime.zero`: ZeRO's user-facing names (partition_parameters) and the optimizer
classes scripts check with isinstance (stage3, stage_1_and_2)."""

from . import partition_parameters, stage3, stage_1_and_2  # noqa: F401
from .partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)
from .stage3 import unwrap_model_for_generation

__all__ = [
    "Init",
    "GatheredParameters",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
