"""`deepspeed.runtime.fp16.unfused_optimizer`: FP16_UnfusedOptimizer, DeepSpeed's fp16 wrapper of an unfused
optimizer without ZeRO; as FP16_Optimizer (fused_optimizer.py), nothing is an instance and construction is refused."""

from ..zero._optimizer_class import ZeroOptimizerMeta, refuse


class FP16_UnfusedOptimizer(metaclass=ZeroOptimizerMeta):  # noqa: N801 (DeepSpeed's name)
    _stages = ()  # isinstance() is false for every zerotron engine's optimizer

    def __init__(self, *args, **kwargs):
        refuse(type(self).__name__)


__all__ = ["FP16_UnfusedOptimizer"]
