"""`deepspeed.runtime.pipe.module`: zerotron's PipelineModule, LayerSpec and TiedLayerSpec."""

from ....pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
