"""`deepspeed.runtime.zero.config`: ZeroStageEnum and DeepSpeedZeroConfig, a `zero_optimization` section
parsed and validated by zerotron's config (DeepSpeed's key names, its old names, its deprecated keys, "auto") with
the attribute names DeepSpeed's config object has (stage3_* keys are read as `prefetch_bucket_size`, ...), and the
offload sections as DeepSpeedZeroOffloadParamConfig / DeepSpeedZeroOffloadOptimizerConfig."""

from __future__ import annotations

import enum

from ....config import Config
from ....config.deepspeed import deepspeed_names
from ....config.resolve import parse_section
from ....config.sections import OffloadConfig, ZeroConfig
from ....errors import ConfigError


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
# DeepSpeed's defaults for keys zerotron warns about and does not keep (config/deepspeed.py), read when unset
_UNKEPT_DEFAULTS = {"pipeline_loading_checkpoint": False}


class _OffloadSection:
    """An offload section, parsed by zerotron's config (the same checks initialize makes), with DeepSpeed's
    attribute names."""

    _key = ""

    def __init__(self, **section):
        parsed = parse_section(OffloadConfig, section, f"zero_optimization.{self._key}.")
        parsed.validate(f"zero_optimization.{self._key}")
        self.section = parsed

    @classmethod
    def of(cls, parsed: OffloadConfig | None):
        if parsed is None:
            return None
        view = cls.__new__(cls)
        view.section = parsed
        return view

    @property
    def pipeline(self) -> bool:  # DeepSpeed's: either direction pipelined
        return self.section.pipeline_read or self.section.pipeline_write

    def __getattr__(self, name):
        if name == "section":
            raise AttributeError(name)
        return getattr(self.section, name)

    def __repr__(self):
        return f"{type(self).__name__}({self.section!r})"


class DeepSpeedZeroOffloadParamConfig(_OffloadSection):
    _key = "offload_param"


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadSection):
    _key = "offload_optimizer"


class DeepSpeedZeroConfig:
    """`DeepSpeedZeroConfig(**section)`: the `zero_optimization` section as zerotron reads it (a wrong key or
    value is the same ConfigError that initialize() raises); attributes by DeepSpeed's names and, for keys not
    given that DeepSpeed defaults by stage (overlap_comm: on at stage 3 only), DeepSpeed's defaults."""

    def __init__(self, **section):
        raw = {"train_batch_size": 1, "zero_optimization": section}
        try:
            self.section = Config.load(raw).zero_optimization
        except ConfigError as e:
            # DeepSpeed's class describes the section alone: optimizer offload at stage 0, which initialize
            # refuses (there is no optimizer shard to offload), is described as given
            if e.key != "zero_optimization.offload_optimizer.device" or "stage" in section:
                raise
            self.section = parse_section(ZeroConfig, deepspeed_names(raw)["zero_optimization"], "zero_optimization.")
        self.given = deepspeed_names(raw)["zero_optimization"]  # after DeepSpeed's old and deprecated names

    def __getattr__(self, name):
        if name in ("section", "given"):
            raise AttributeError(name)
        if name == "overlap_comm" and name not in self.given:
            return self.section.stage == 3  # DeepSpeed's default (zerotron overlaps at every stage)
        if name in _UNKEPT_DEFAULTS:
            return self.given.get(name, _UNKEPT_DEFAULTS[name])
        if name == "offload_param":
            return DeepSpeedZeroOffloadParamConfig.of(self.section.offload_param)
        if name == "offload_optimizer":
            return DeepSpeedZeroOffloadOptimizerConfig.of(self.section.offload_optimizer)
        return getattr(self.section, _ATTRIBUTES.get(name, name))

    def __repr__(self):
        return f"DeepSpeedZeroConfig({self.section!r})"


__all__ = [
    "ZeroStageEnum",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
]
