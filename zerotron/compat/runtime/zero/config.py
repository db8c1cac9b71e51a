"""`deepspeed.runtime.zero.config`: ZeroStageEnum and DeepSpeedZeroConfig, a `zero_optimization` section
parsed and validated by zerotron's config (DeepSpeed's key names, its old names, "auto") with the attribute
names DeepSpeed's config object has (stage3_* keys are read as `prefetch_bucket_size`, ...)."""

from __future__ import annotations

import enum

from ....config import Config


class ZeroStageEnum(enum.IntEnum):
    """DeepSpeed's names for the ZeRO stages (its optimizer checkpoints pickle this class)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# DeepSpeed's attribute -> the section's key (DeepSpeed reads the stage3_* keys under shorter names)
_ATTRIBUTES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


class DeepSpeedZeroConfig:
    """`DeepSpeedZeroConfig(**section)`: the `zero_optimization` section as zerotron reads it (a wrong key or
    value is the same ConfigError that initialize() raises); attributes by DeepSpeed's names."""

    def __init__(self, **section):
        config = Config.load({"train_batch_size": 1, "zero_optimization": section})
        self.section = config.zero_optimization

    def __getattr__(self, name):
        if name == "section":
            raise AttributeError(name)
        key = _ATTRIBUTES.get(name, name)
        value = getattr(self.section, key)
        if name == "gather_16bit_weights_on_model_save":  # either of DeepSpeed's two names turns it on
            value = value or self.section.stage3_gather_fp16_weights_on_model_save
        return value

    def __repr__(self):
        return f"DeepSpeedZeroConfig({self.section!r})"


__all__ = ["ZeroStageEnum", "DeepSpeedZeroConfig"]
