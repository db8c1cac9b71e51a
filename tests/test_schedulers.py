"""LR schedulers: trajectories against hand-computed DeepSpeed formulas, resume and stepping to an index
(what each config accepts: test_scheduler_validation.py)."""

import json
import math

import pytest
import torch
from scheduler_cases import ALL, ONE_CYCLE, lrs, make_opt, run_to

from zerotron.errors import ConfigError
from zerotron.schedulers import OneCycle, WarmupCosineLR, WarmupLR, build_scheduler

# ---------------------------------------------------------------- WarmupLR


def test_warmup_log_trajectory():
    opt = make_opt()
    sched = build_scheduler("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}, opt)
    # Set at construction, before any step.
    assert lrs(opt) == [0.001]
    assert sched.get_last_lr() == [0.001]
    expected = {k: 0.001 + 0.009 * math.log(k + 1) / math.log(10) for k in range(10)}
    expected.update({10: 0.01, 25: 0.01})
    for k in sorted(expected):
        run_to(sched, k)
        assert lrs(opt)[0] == pytest.approx(expected[k], rel=1e-12), k
        assert sched.get_last_lr() == lrs(opt)
    # Log warmup reaches the max one step early (step W-1).
    assert expected[0] == 0.001 and expected[9] == pytest.approx(0.01)


def test_warmup_linear_trajectory():
    opt = make_opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.04, warmup_num_steps=4, warmup_type="linear")
    seen = []
    for _ in range(6):
        sched.step()
        seen.append(lrs(opt)[0])
    assert seen == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04, 0.04])


def test_warmup_one_step_is_clamped_to_two():
    # warmup_num_steps=1 behaves as 2 (log(1) would be 0): linear is only half way at step 1.
    opt = make_opt()
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    sched.step(1)
    assert lrs(opt) == [0.5]
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="log")
    sched.step(1)
    assert lrs(opt) == [pytest.approx(1.0)]


def test_warmup_max_lr_defaults():
    # WarmupLR takes the optimizer's lr as its max; WarmupDecayLR defaults to 0.001.
    opt = make_opt((0.3,))
    sched = build_scheduler("WarmupLR", {"warmup_num_steps": 5}, opt)
    assert lrs(opt) == [0.0]
    sched.step(4)
    assert lrs(opt) == [pytest.approx(0.3)]
    opt = make_opt((0.3,))
    sched = build_scheduler("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 5}, opt)
    sched.step(5)
    assert lrs(opt) == [pytest.approx(0.001)]


def test_warmup_per_group_values():
    opt = make_opt((0.5, 0.5))
    sched = WarmupLR(
        opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.02], warmup_num_steps=10, warmup_type="linear"
    )
    assert lrs(opt) == [0.0, 0.01]
    sched.step(5)
    assert lrs(opt) == pytest.approx([0.05, 0.015])
    sched.step(12)
    assert lrs(opt) == pytest.approx([0.1, 0.02])


def test_per_group_list_of_wrong_length():
    with pytest.raises(ConfigError) as err:
        WarmupLR(make_opt((0.1, 0.1)), warmup_max_lr=[0.1, 0.2, 0.3])
    assert err.value.key == "scheduler.params.warmup_max_lr"
    with pytest.raises(ConfigError):
        OneCycle(make_opt((0.1,), "adam"), [0.1, 0.2], 0.5)


# ---------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_trajectory():
    opt = make_opt()
    sched = build_scheduler(
        "WarmupDecayLR",
        {
            "total_num_steps": 20,
            "warmup_min_lr": 0.001,
            "warmup_max_lr": 0.016,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
        opt,
    )
    assert lrs(opt) == [0.001]
    delta = 0.015
    expected = {
        0: 0.001,
        3: 0.001 + delta * 3 / 5,  # warming up
        5: 0.016,  # decay starts at the max: (20-5)/15 = 1
        10: 0.001 + delta * (20 - 10) / 15,  # linear decay
        19: 0.001 + delta * 1 / 15,
        20: 0.001,  # end of decay: back at warmup_min_lr
        30: 0.001,  # clamped, never below
    }
    for k in sorted(expected):
        run_to(sched, k)
        assert lrs(opt)[0] == pytest.approx(expected[k], rel=1e-12), k


# ---------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_trajectory():
    opt = make_opt((0.1, 0.02))
    sched = build_scheduler(
        "WarmupCosineLR",
        {
            "total_num_steps": 21,
            "warmup_num_steps": 5,
            "warmup_min_ratio": 0.2,
            "cos_min_ratio": 0.1,
            "warmup_type": "linear",
        },
        opt,
    )
    # Starts at 0, not at warmup_min_ratio * lr.
    assert lrs(opt) == [0.0, 0.0]

    def ratio_after_warmup(k):
        progress = min(1.0, (k - 5 + 1) / (21 - 5))
        return 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2

    expected = {
        0: 0.2,
        2: 0.2 + 0.8 * 2 / 5,
        5: ratio_after_warmup(5),  # already one step into the cosine
        12: 0.55,  # cosine midpoint: progress 8/16, ratio halfway to cos_min_ratio
        20: 0.1,  # end: cos_min_ratio at step total_num_steps - 1
        40: 0.1,  # and held there
    }
    assert expected[5] < 1.0
    for k in sorted(expected):
        run_to(sched, k)
        assert lrs(opt) == pytest.approx([0.1 * expected[k], 0.02 * expected[k]], rel=1e-12), k
        assert sched.get_lr_ratio() == pytest.approx(expected[k])


def test_warmup_cosine_log_warmup_hits_one():
    opt = make_opt((0.1,))
    sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=5)
    sched.step(2)
    assert lrs(opt) == [pytest.approx(0.1 * math.log(3) / math.log(5))]
    sched.step(4)
    assert lrs(opt) == [pytest.approx(0.1)]


# ---------------------------------------------------------------- OneCycle


def test_one_cycle_lr_and_momentum_with_adam():
    opt = make_opt((0.1,), "adam")
    sched = build_scheduler("OneCycle", ONE_CYCLE, opt)
    # Construction puts both low ends in place; beta2 becomes 0.99 (Adam's 0.999 is replaced).
    assert lrs(opt) == [0.001]
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    with pytest.raises(RuntimeError):
        sched.get_last_lr()
    # Step k sits at position k+1 of the 10-step cycle: up over 4 steps, down over 6.
    expected = {  # step: (position in cycle 0..1, or None in decay, lr, beta1)
        0: (0.25, 0.001 + 0.01 * 0.25, 0.9 - 0.1 * 0.25),
        3: (1.0, 0.011, 0.8),  # peak lr, lowest momentum
        6: (0.5, 0.006, 0.85),  # half way down
        9: (0.0, 0.001, 0.9),  # cycle done
        10: (None, 0.001 / (1 + 0.5 * 0.5), 0.9 * (1 + 0.01 * 0.5)),  # (10-10+1)/2 = 0.5 intervals
        13: (None, 0.001 / (1 + 0.5 * 2), 0.9 * (1 + 0.01 * 2)),  # 4/2 = 2 intervals, not rounded
    }
    for k in sorted(expected):
        run_to(sched, k)
        _, lr, beta1 = expected[k]
        assert lrs(opt) == [pytest.approx(lr, rel=1e-12)], k
        assert sched.get_last_lr() == lrs(opt)
        beta = opt.param_groups[0]["betas"]
        assert beta[0] == pytest.approx(beta1, rel=1e-12) and beta[1] == 0.99, k
        assert sched.get_mom() == [beta]


def test_one_cycle_staircase():
    opt = make_opt((0.1,), "adam")
    sched = OneCycle(
        opt,
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=9,
        cycle_second_step_size=6,
        cycle_first_stair_count=3,
        cycle_second_stair_count=2,
    )
    # Rising half: 3 stairs of 3 steps; falling half: 2 stairs of 3 steps (offset = step + 1).
    expected = {0: 0.0, 1: 0.0, 2: 1 / 3, 5: 2 / 3, 7: 2 / 3, 8: 1.0, 9: 0.5, 11: 0.5, 12: 0.0, 14: 0.0}
    for k in sorted(expected):
        run_to(sched, k)
        assert lrs(opt) == [pytest.approx(expected[k])], k
        assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 - 0.1 * expected[k]), k


def test_one_cycle_without_decay_holds_cycle_ends():
    opt = make_opt((0.1,), "adam")
    sched = OneCycle(opt, 0.001, 0.01, cycle_first_step_size=3, decay_lr_rate=0.5)  # decay_step_size 0
    # cycle_second_step_size defaults to the first: 6-step cycle.
    assert sched.total_size == 6
    sched.step(2)
    assert lrs(opt) == [pytest.approx(0.01)]
    sched.step(50)
    assert lrs(opt) == [0.001]
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)


def test_one_cycle_sgd_momentum_untouched():
    # Only optimizers with betas have momentum cycled.
    opt = make_opt((0.1, 0.1), "sgd")
    sched = OneCycle(opt, [0.001, 0.002], [0.011, 0.022], cycle_first_step_size=4)
    sched.step(1)
    assert lrs(opt) == pytest.approx([0.001 + 0.01 * 0.5, 0.002 + 0.02 * 0.5])
    assert sched.get_mom() is None
    assert all(g["momentum"] == 0.9 and "betas" not in g for g in opt.param_groups)


def test_one_cycle_per_group_momentum():
    opt = make_opt((0.1, 0.1), "adam")
    sched = OneCycle(opt, 0.001, 0.011, cycle_first_step_size=4, cycle_min_mom=[0.8, 0.7], cycle_max_mom=[0.9, 0.95])
    assert [g["betas"][0] for g in opt.param_groups] == [0.8, 0.7]
    sched.step(3)  # peak
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.7])
    sched.step(0)
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.875, 0.95 - 0.25 * 0.25])


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("name,params", ALL)
def test_state_dict_round_trip(name, params):
    opt = make_opt((0.1, 0.05), "adam")
    sched = build_scheduler(name, params, opt)
    for _ in range(7):
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))  # JSON-serialisable
    assert state == {"last_batch_iteration": 6}

    resumed_opt = make_opt((0.1, 0.05), "adam")
    resumed = build_scheduler(name, params, resumed_opt)
    resumed.load_state_dict(state)
    for _ in range(12):  # spans the end of warmup / cycle / decay
        sched.step()
        resumed.step()
        assert lrs(resumed_opt) == lrs(opt)
        assert resumed.get_last_lr() == sched.get_last_lr()
        assert [g["betas"] for g in resumed_opt.param_groups] == [g["betas"] for g in opt.param_groups]


@pytest.mark.parametrize("name,params", ALL)
def test_step_to_explicit_index(name, params):
    walked_opt, jumped_opt = make_opt((0.1,)), make_opt((0.1,))
    walked = build_scheduler(name, params, walked_opt)
    jumped = build_scheduler(name, params, jumped_opt)
    run_to(walked, 9)
    jumped.step(9)
    assert jumped.last_batch_iteration == 9
    assert lrs(jumped_opt) == lrs(walked_opt)
    jumped.step()  # continues from the index it was given
    walked.step()
    assert lrs(jumped_opt) == lrs(walked_opt)


def test_resume_index_does_not_touch_optimizer_at_construction():
    opt = make_opt((0.1,))
    sched = WarmupLR(opt, warmup_max_lr=0.5, warmup_num_steps=10, last_batch_iteration=4)
    assert lrs(opt) == [0.1]
    sched.step()
    assert lrs(opt) == [pytest.approx(0.5 * math.log(6) / math.log(10))]


def test_tensor_lr_is_filled_in_place():
    lr = torch.tensor(0.1)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    tensor = opt.param_groups[0]["lr"]
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    sched.step(1)
    assert opt.param_groups[0]["lr"] is tensor
    assert float(tensor) == pytest.approx(0.05)


def test_wrapped_optimizer_is_unwrapped():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = make_opt((0.1,))
    sched = WarmupLR(Wrapper(opt), warmup_max_lr=0.2, warmup_num_steps=2, warmup_type="linear")
    sched.step(1)
    assert sched.optimizer is opt and lrs(opt) == [0.1]
    with pytest.raises(TypeError):
        WarmupLR(object())
