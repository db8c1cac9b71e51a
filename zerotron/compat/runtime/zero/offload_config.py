"""`deepspeed.runtime.zero.offload_config`: the names scripts pass to `engine.offload_states(include=...,
device=...)` (DeepSpeedExamples' training/offload_states). zerotron's engine reads their values; which
kinds and devices it moves is the engine's rule (engine/accessors.py: the optimizer states, to the CPU)."""

from __future__ import annotations

import enum


class OffloadDeviceEnum(str, enum.Enum):
    """Where DeepSpeed offloads to (also the offload_optimizer / offload_param `device` values)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The training states DeepSpeed's offload_states names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
