"""`deepspeed.runtime.engine`: DeepSpeedEngine is zerotron's Engine (what initialize returns)."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Union

from torch.nn import Parameter
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ...engine import Engine
from .config import (
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAM_W_MODE,
    ADAM_W_MODE_DEFAULT,
    ADAMW_OPTIMIZER,
    DEEPSPEED_OPTIMIZERS,
    LAMB_OPTIMIZER,
    LION_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUON_OPTIMIZER,
    MUSGD_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    TORCH_ADAM_PARAM,
    ZERO_ONE_ADAM_OPTIMIZER,
)

DeepSpeedEngine = Engine

# What initialize(optimizer=..., lr_scheduler=...) accepts as callables, as DeepSpeed types them.
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[Parameter], Dict[str, Iterable]]], Optimizer]
DeepSpeedSchedulerCallable = Callable[[Optimizer], LRScheduler]

__all__ = [
    "DeepSpeedEngine",
    "DeepSpeedOptimizerCallable",
    "DeepSpeedSchedulerCallable",
    "ADAGRAD_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "LAMB_OPTIMIZER",
    "ONEBIT_ADAM_OPTIMIZER",
    "ONEBIT_LAMB_OPTIMIZER",
    "ZERO_ONE_ADAM_OPTIMIZER",
    "MUADAM_OPTIMIZER",
    "MUADAMW_OPTIMIZER",
    "MUSGD_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUON_OPTIMIZER",
    "DEEPSPEED_OPTIMIZERS",
    "TORCH_ADAM_PARAM",
    "ADAM_W_MODE",
    "ADAM_W_MODE_DEFAULT",
]
