"""Pipeline parallelism: `PipelineModule` (DeepSpeed's API), schedules and the pipeline engine."""

from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .schedule import SCHEDULES, build_schedule, simulate, theoretical_bubble

__all__ = [
    "LayerSpec",
    "TiedLayerSpec",
    "PipelineModule",
    "SCHEDULES",
    "build_schedule",
    "simulate",
    "theoretical_bubble",
]
