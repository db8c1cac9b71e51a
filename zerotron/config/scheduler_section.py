"""The "scheduler" section's checks: which DeepSpeed scheduler types exist and what each parameter
accepts (zerotron/schedulers.py runs them; a config is checked before any scheduler is built)."""

from __future__ import annotations

import math

from ..errors import ConfigError
from .sections import as_bool, is_auto

SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
LOG, LINEAR = "log", "linear"
WARMUP_TYPES = (LOG, LINEAR)
DEFAULT_WARMUP_STEPS = 1000

# Each rule is (accepts(value) -> bool, what a valid value looks like).


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _per_group_rule(accepts, what):
    # lr/momentum bounds may be one number for all groups or a list with one per group.
    def check(v):
        if isinstance(v, (list, tuple)):
            return len(v) > 0 and all(accepts(x) for x in v)
        return accepts(v)

    return check, f"{what}, or a list of them (one per param group)"


_LR = _per_group_rule(lambda v: _is_number(v) and v >= 0, "a number >= 0")
_LR_OR_NONE = (lambda v: v is None or _LR[0](v), _LR[1] + ", or null for the optimizer's lr")
_MOMENTUM = _per_group_rule(lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
_POSITIVE_INT = (lambda v: _is_int(v) and v > 0, "an integer > 0")
_POSITIVE = (lambda v: _is_number(v) and v > 0, "a number > 0")
_NON_NEGATIVE = (lambda v: _is_number(v) and v >= 0, "a number >= 0")
_NON_NEGATIVE_OR_NONE = (lambda v: v is None or _NON_NEGATIVE[0](v), "a number >= 0, or null")
_COUNT = (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = no staircase)")
_WARMUP_STEPS = (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (fewer than 2 count as 2, as in DeepSpeed)")
_COUNT_OR_NONE = (lambda v: v is None or _COUNT[0](v), "an integer >= 0, or null for cycle_first_stair_count")
_RATIO = (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
_ANY_NUMBER = (_is_number, "a number")  # decay_mom_rate < 0 is how momentum decays downward
_BOOL = (lambda v: as_bool(v) is not None, "true or false (or 1 / 0)")
_WARMUP_TYPE = (lambda v: v in WARMUP_TYPES, f"one of {list(WARMUP_TYPES)}")
_ITERATION = (lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1 = start from the beginning)")

_WARMUP_RULES = {
    "warmup_min_lr": _LR,
    "warmup_max_lr": _LR_OR_NONE,
    "warmup_num_steps": _WARMUP_STEPS,
    "warmup_type": _WARMUP_TYPE,
    "last_batch_iteration": _ITERATION,
}
_RULES = {
    "WarmupLR": _WARMUP_RULES,
    "WarmupDecayLR": {"total_num_steps": _POSITIVE, **_WARMUP_RULES},
    "WarmupCosineLR": {
        "total_num_steps": _POSITIVE,
        "warmup_min_ratio": _RATIO,
        "warmup_num_steps": _WARMUP_STEPS,
        "cos_min_ratio": _RATIO,
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _ITERATION,
    },
    "OneCycle": {
        "cycle_min_lr": _LR,
        "cycle_max_lr": _LR,
        "decay_lr_rate": _NON_NEGATIVE,
        "cycle_first_step_size": _POSITIVE,
        "cycle_second_step_size": _NON_NEGATIVE_OR_NONE,
        "cycle_first_stair_count": _COUNT,
        "cycle_second_stair_count": _COUNT_OR_NONE,
        "decay_step_size": _NON_NEGATIVE,
        "cycle_momentum": _BOOL,
        "cycle_min_mom": _MOMENTUM,
        "cycle_max_mom": _MOMENTUM,
        "decay_mom_rate": _ANY_NUMBER,
        "last_batch_iteration": _ITERATION,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": _LR,
        "lr_range_test_step_size": _POSITIVE_INT,
        "lr_range_test_step_rate": _NON_NEGATIVE,
        "lr_range_test_staircase": _BOOL,
        "last_batch_iteration": _ITERATION,
    },
}
# Parameters the scheduler cannot run without (no DeepSpeed default).
_REQUIRED = {
    "WarmupLR": (),
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
    "LRRangeTest": (),
}


def validate_scheduler(type_name: str, params: dict) -> None:
    """Raise ConfigError for a scheduler block DeepSpeed would reject or silently misrun.

    Values "auto" pass: they are filled in from the training setup before build_scheduler.
    """
    if type_name not in SCHEDULER_TYPES:
        raise ConfigError("scheduler.type", type_name, f"use one of {sorted(SCHEDULER_TYPES)}")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ConfigError("scheduler.params", params, "give a JSON object of scheduler parameters")
    rules = _RULES[type_name]
    for name, value in params.items():
        if name not in rules:
            raise ConfigError(f"scheduler.params.{name}", value, f"{type_name} takes only {sorted(rules)}")
        accepts, what = rules[name]
        if not is_auto(value) and not accepts(value):
            raise ConfigError(f"scheduler.params.{name}", value, f"{name} must be {what}")
    for name in _REQUIRED[type_name]:
        if name not in params:
            raise ConfigError(f"scheduler.params.{name}", None, f"{type_name} needs {name}")
    if "total_num_steps" in params:
        total = params["total_num_steps"]
        warmup = params.get("warmup_num_steps", DEFAULT_WARMUP_STEPS)
        # DeepSpeed only warns; a decay that ends before warmup does is a misconfiguration.
        if not is_auto(total) and not is_auto(warmup) and total < warmup:
            raise ConfigError("scheduler.params.total_num_steps", total, f"must be >= warmup_num_steps ({warmup})")
