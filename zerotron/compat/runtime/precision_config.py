"""`deepspeed.runtime.precision_config`: the fp16 / bf16 sections as zerotron's config reads them (the same values,
defaults and ConfigError as initialize()), under DeepSpeed's names. Its pydantic models' own behaviour (their
ValidationError, field coercions) is not reproduced: a wrong value is zerotron's ConfigError, a ValueError."""

from __future__ import annotations

from ...config import Config


def _section(name: str, fields: dict):
    return getattr(Config.load({"train_batch_size": 1, name: dict(fields)}), name)


def DeepSpeedFP16Config(**fields):  # noqa: N802 (DeepSpeed's class name)
    """The "fp16" section with these keys (zerotron.config.sections.FP16Config)."""
    return _section("fp16", fields)


def DeepSpeedBF16Config(**fields):  # noqa: N802 (DeepSpeed's class name)
    """The "bf16" section with these keys (zerotron.config.sections.BF16Config)."""
    return _section("bf16", fields)


def get_float16_config(param_dict: dict):
    return _section("fp16", param_dict.get("fp16", {}))


def get_bfloat16_config(param_dict: dict):
    """The bf16 section of a whole config dict, under either of DeepSpeed's names ("bf16", or the older "bfloat16")."""
    return _section("bf16", param_dict.get("bf16", param_dict.get("bfloat16", {})))


__all__ = ["DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config", "get_bfloat16_config"]
