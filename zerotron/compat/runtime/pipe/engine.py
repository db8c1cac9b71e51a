"""`deepspeed.runtime.pipe.engine`: zerotron's PipelineEngine (what initialize returns for a PipelineModule)."""

from ....engine import PipelineEngine

__all__ = ["PipelineEngine"]
