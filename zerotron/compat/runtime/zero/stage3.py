"""`deepspeed.runtime.zero.stage3`: `isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`
is true exactly when a zerotron engine with ZeRO stage 3 drives that optimizer; `unwrap_model_for_generation`."""

from ....zero import unwrap_model_for_generation  # noqa: F401 (DeepSpeed's home of it)
from ._optimizer_class import ZeroOptimizerMeta, refuse


class DeepSpeedZeroOptimizer_Stage3(metaclass=ZeroOptimizerMeta):
    _stages = (3,)

    def __init__(self, *args, **kwargs):
        refuse(type(self).__name__)


__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]
