"""The engines: `Engine` (engine.py: forward / backward / step on one model replica per rank; its
DeepSpeed-shaped accessors in accessors.py) and `PipelineEngine` (pipeline.py: the same verbs over
a pipeline's stages, driving pipe/'s schedules and transfers)."""

from .engine import Engine
from .pipeline import PipelineEngine

__all__ = ["Engine", "PipelineEngine"]
