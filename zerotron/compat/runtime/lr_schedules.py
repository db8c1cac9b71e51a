"""`deepspeed.runtime.lr_schedules`: the schedulers (zerotron/schedulers.py),
the parameter-name constants and DeepSpeed's command-line tuning arguments."""

from __future__ import annotations

import argparse

import torch

from ...schedulers import (  # noqa: F401  (DeepSpeed's names)
    LRRangeTest,
    OneCycle,
    Scheduler,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    per_group,
    torch_optimizer,
    write_groups,
)

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"


def get_torch_optimizer(optimizer):
    """The torch optimizer inside `optimizer` (itself, or its `.optimizer`)."""
    return torch_optimizer(optimizer)


def update_lr(param_groups, lrs):
    """Write one lr per param group (in place for tensor lrs); returns the groups' lrs."""
    return write_groups(param_groups, "lr", [lr.squeeze() if torch.is_tensor(lr) else lr for lr in lrs])


def _bool(text):
    if isinstance(text, bool):
        return text
    if str(text).lower() in ("1", "true", "yes", "y", "on"):
        return True
    if str(text).lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's "Convergence Tuning" flags (--lr_schedule and each schedule's parameters)."""
    g = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    g.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    g.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="Starting lr value.")
    g.add_argument("--lr_range_test_step_rate", type=float, default=1.0, help="scaling rate for LR range test.")
    g.add_argument("--lr_range_test_step_size", type=int, default=1000, help="training steps per LR change.")
    g.add_argument(
        "--lr_range_test_staircase", type=_bool, default=False, help="use staircase scaling for LR range test."
    )
    g.add_argument(
        "--cycle_first_step_size",
        type=int,
        default=1000,
        help="size of first step of 1Cycle schedule (training steps).",
    )
    g.add_argument("--cycle_first_stair_count", type=int, default=-1, help="first stair count for 1Cycle schedule.")
    g.add_argument(
        "--cycle_second_step_size",
        type=int,
        default=-1,
        help="size of second step of 1Cycle schedule (default first_step_size).",
    )
    g.add_argument("--cycle_second_stair_count", type=int, default=-1, help="second stair count for 1Cycle schedule.")
    g.add_argument(
        "--decay_step_size",
        type=int,
        default=1000,
        help="size of intervals for applying post cycle decay (training steps).",
    )
    g.add_argument("--cycle_min_lr", type=float, default=0.01, help="1Cycle LR lower bound.")
    g.add_argument("--cycle_max_lr", type=float, default=0.1, help="1Cycle LR upper bound.")
    g.add_argument("--decay_lr_rate", type=float, default=0.0, help="post cycle LR decay rate.")
    g.add_argument("--cycle_momentum", default=False, action="store_true", help="Enable 1Cycle momentum schedule.")
    g.add_argument("--cycle_min_mom", type=float, default=0.8, help="1Cycle momentum lower bound.")
    g.add_argument("--cycle_max_mom", type=float, default=0.9, help="1Cycle momentum upper bound.")
    g.add_argument("--decay_mom_rate", type=float, default=0.0, help="post cycle momentum decay rate.")
    g.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR minimum/initial LR value")
    g.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR maximum LR value.")
    g.add_argument("--warmup_num_steps", type=int, default=1000, help="WarmupLR step count for LR warmup.")
    g.add_argument(
        "--warmup_type", type=str, default=WARMUP_LOG_RATE, help="WarmupLR increasing function during warmup"
    )
    g.add_argument("--warmup_min_ratio", type=float, default=0.01, help="Cosine LR lower bound.")
    g.add_argument("--cos_min_ratio", type=float, default=0.01, help="Cosine LR lower bound.")
    return parser


def parse_arguments():
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


_RANGE_TEST_KEYS = (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE)
_ONE_CYCLE_KEYS = (
    CYCLE_FIRST_STEP_SIZE,
    CYCLE_FIRST_STAIR_COUNT,
    CYCLE_SECOND_STEP_SIZE,
    CYCLE_SECOND_STAIR_COUNT,
    DECAY_STEP_SIZE,
    CYCLE_MIN_LR,
    CYCLE_MAX_LR,
    DECAY_LR_RATE,
    CYCLE_MIN_MOM,
    CYCLE_MAX_MOM,
    DECAY_MOM_RATE,
)
_WARMUP_KEYS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)


def _override(args, params, keys):
    for key in keys:
        if getattr(args, key, None) is not None:
            params[key] = getattr(args, key)


def override_lr_range_test_params(args, params):
    _override(args, params, _RANGE_TEST_KEYS)


def override_1cycle_params(args, params):
    _override(args, params, _ONE_CYCLE_KEYS)


def override_warmupLR_params(args, params):
    _override(args, params, _WARMUP_KEYS)


def override_params(args, params):
    for keys in (_RANGE_TEST_KEYS, _ONE_CYCLE_KEYS, _WARMUP_KEYS):
        _override(args, params, keys)


def get_config_from_args(args):
    """({"type": ..., "params": {...}}, None) from --lr_schedule and its flags, or (None, why not)."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    keys = {LR_RANGE_TEST: _RANGE_TEST_KEYS, ONE_CYCLE: _ONE_CYCLE_KEYS}.get(schedule, _WARMUP_KEYS)
    params = {}
    _override(args, params, keys)
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config):
    """(the schedule's peak or starting lr, "") from a scheduler section, or (None, why not)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(schedule, WARMUP_MAX_LR)
    return params[key], ""
