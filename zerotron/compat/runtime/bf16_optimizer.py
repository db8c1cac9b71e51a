"""`deepspeed.runtime.bf16_optimizer`: BF16_Optimizer, DeepSpeed's bf16 wrapper (fp32 masters without ZeRO, or
with stage 1). zerotron keeps its fp32 masters inside the engine's ZeRO state, so no optimizer is an instance of
it and constructing one is refused with what to do instead (as fp16/fused_optimizer.py's FP16_Optimizer)."""

from .zero._optimizer_class import ZeroOptimizerMeta, refuse


class BF16_Optimizer(metaclass=ZeroOptimizerMeta):  # noqa: N801 (DeepSpeed's name)
    _stages = ()  # isinstance() is false for every zerotron engine's optimizer

    def __init__(self, *args, **kwargs):
        refuse(type(self).__name__)


__all__ = ["BF16_Optimizer"]
