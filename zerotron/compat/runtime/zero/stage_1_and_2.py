"""`deepspeed.runtime.zero.stage_1_and_2`: `isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`
is true exactly when a zerotron engine with ZeRO stage 1 or 2 drives that optimizer."""

from ._optimizer_class import ZeroOptimizerMeta, refuse


class DeepSpeedZeroOptimizer(metaclass=ZeroOptimizerMeta):
    _stages = (1, 2)

    def __init__(self, *args, **kwargs):
        refuse(type(self).__name__)


__all__ = ["DeepSpeedZeroOptimizer"]
