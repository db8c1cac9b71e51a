"""`deepspeed.runtime.pipe`: PipelineModule, LayerSpec, TiedLayerSpec (zerotron.pipe) and the topologies."""

from . import engine, module, topology  # noqa: F401
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "PipelineModule",
    "LayerSpec",
    "TiedLayerSpec",
    "ProcessTopology",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
]
