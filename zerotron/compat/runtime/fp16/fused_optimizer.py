"""`deepspeed.runtime.fp16.fused_optimizer`: FP16_Optimizer, DeepSpeed's fp16 wrapper of a fused optimizer without
ZeRO. zerotron has no such wrapper (engine.optimizer is the torch optimizer; the loss scaler lives in the engine),
so no optimizer is an instance of it and constructing one is refused with what to do instead."""

from ..zero._optimizer_class import ZeroOptimizerMeta, refuse


class FP16_Optimizer(metaclass=ZeroOptimizerMeta):  # noqa: N801 (DeepSpeed's name)
    _stages = ()  # isinstance() is false for every zerotron engine's optimizer

    def __init__(self, *args, **kwargs):
        refuse(type(self).__name__)


__all__ = ["FP16_Optimizer"]
