"""LR scheduler configs: what validate_scheduler accepts and refuses (the ConfigError names the key and
its fix), that the validation table matches each scheduler's constructor, and that build_scheduler
validates before it touches the optimizer."""

import inspect

import pytest
import torch
from scheduler_cases import ALL, ONE_CYCLE, lrs, make_opt

from zerotron.errors import ConfigError
from zerotron.schedulers import SCHEDULERS, OneCycle, WarmupDecayLR, WarmupLR, build_scheduler, validate_scheduler


def test_accepted_params_match_constructors():
    # The validation table must cover exactly what each class takes as JSON params.
    from zerotron.config.scheduler_section import _RULES

    for name, cls in SCHEDULERS.items():
        args = list(inspect.signature(cls).parameters)
        assert args[0] == "optimizer"
        assert set(args[1:]) == set(_RULES[name]), name


# ---------------------------------------------------------------- validation


def config_error(type_name, params):
    with pytest.raises(ConfigError) as err:
        validate_scheduler(type_name, params)
    return err.value


def test_unknown_type():
    err = config_error("CosineAnnealing", {})
    assert err.key == "scheduler.type" and err.value == "CosineAnnealing"
    assert all(name in err.fix for name in SCHEDULERS)


def test_unknown_param_lists_valid_names():
    err = config_error("WarmupLR", {"warmup_max_lr": 0.1, "warmup_steps": 100})
    assert err.key == "scheduler.params.warmup_steps" and err.value == 100
    assert "warmup_num_steps" in err.fix and "warmup_min_lr" in err.fix
    # Parameters of one scheduler are not valid for another.
    assert config_error("WarmupLR", {"total_num_steps": 10}).key == "scheduler.params.total_num_steps"
    assert (
        config_error("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "warmup_type": "log"}).key
        == "scheduler.params.warmup_type"
    )


@pytest.mark.parametrize(
    "type_name,params,bad",
    [
        ("WarmupLR", {"warmup_num_steps": -5}, "warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": -1}, "warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": 10.5}, "warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": True}, "warmup_num_steps"),
        ("WarmupLR", {"warmup_type": "cosine"}, "warmup_type"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, "warmup_min_lr"),
        ("WarmupLR", {"warmup_max_lr": "1e-3"}, "warmup_max_lr"),
        ("WarmupLR", {"warmup_max_lr": [0.1, "x"]}, "warmup_max_lr"),
        ("WarmupLR", {"last_batch_iteration": -2}, "last_batch_iteration"),
        ("WarmupDecayLR", {"total_num_steps": -1, "warmup_num_steps": 1}, "total_num_steps"),
        ("WarmupCosineLR", {"total_num_steps": 100, "cos_min_ratio": 1.5}, "cos_min_ratio"),
        ("WarmupCosineLR", {"total_num_steps": 100, "warmup_min_ratio": -0.1}, "warmup_min_ratio"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}, "cycle_first_step_size"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_second_step_size": -1}, "cycle_second_step_size"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_stair_count": 1.5},
            "cycle_first_stair_count",
        ),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "decay_step_size": -2}, "decay_step_size"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "decay_lr_rate": -0.5}, "decay_lr_rate"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": "yes"}, "cycle_momentum"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.2}, "cycle_max_mom"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": float("nan")}, "cycle_max_lr"),
    ],
)
def test_bad_values(type_name, params, bad):
    err = config_error(type_name, params)
    assert err.key == f"scheduler.params.{bad}"
    assert err.value is params[bad] or err.value == params[bad]
    assert bad in err.fix


def test_missing_required_params():
    assert config_error("WarmupDecayLR", {}).key == "scheduler.params.total_num_steps"
    assert config_error("WarmupCosineLR", {"warmup_num_steps": 5}).key == "scheduler.params.total_num_steps"
    assert config_error("OneCycle", {"cycle_min_lr": 0.1}).key == "scheduler.params.cycle_max_lr"


def test_total_steps_shorter_than_warmup():
    err = config_error("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 100})
    assert err.key == "scheduler.params.total_num_steps" and "100" in err.fix
    # The default warmup_num_steps (1000) counts too.
    assert config_error("WarmupCosineLR", {"total_num_steps": 500}).key == "scheduler.params.total_num_steps"
    validate_scheduler("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 100})


def test_params_must_be_a_dict():
    assert config_error("WarmupLR", [1, 2]).key == "scheduler.params"


def test_valid_configs_pass():
    for name, params in ALL:
        validate_scheduler(name, params)
    validate_scheduler("WarmupLR", {})
    validate_scheduler("WarmupLR", None)
    validate_scheduler(
        "OneCycle",
        {
            "cycle_min_lr": [0.1, 0.2],
            "cycle_max_lr": [1, 2],
            "cycle_second_step_size": None,
            "cycle_second_stair_count": None,
            "decay_mom_rate": -0.1,
        },
    )


def test_auto_is_accepted_by_validate_but_not_build():
    params = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}
    validate_scheduler("WarmupDecayLR", params)
    validate_scheduler("WarmupCosineLR", {"total_num_steps": "auto", "warmup_num_steps": 2000})
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupDecayLR", params, make_opt())
    assert "auto" in err.value.fix


def test_build_validates_first():
    opt = make_opt((0.1,))
    with pytest.raises(ConfigError):
        build_scheduler("WarmupLR", {"warmup_type": "exp"}, opt)
    assert lrs(opt) == [0.1]  # nothing was applied
    assert isinstance(build_scheduler("OneCycle", ONE_CYCLE, make_opt()), OneCycle)
    assert isinstance(build_scheduler("WarmupDecayLR", {"total_num_steps": 2000}, make_opt()), WarmupDecayLR)


def test_zero_warmup_steps_count_as_two_as_in_deepspeed():
    # the Hugging Face Trainer writes warmup_num_steps 0 when there is no warm-up; DeepSpeed takes it
    validate_scheduler("WarmupLR", {"warmup_num_steps": 0})
    lrs = []
    for n in (0, 2):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=n, warmup_type="linear")
        lrs.append([])
        for _ in range(3):
            lrs[-1].append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert lrs[0] == lrs[1]
