"""What the LR scheduler tests share (test_schedulers.py, test_scheduler_validation.py): optimizers to
schedule, stepping helpers, and one config of each scheduler."""

import torch


def make_opt(lrs=(0.1,), kind="sgd"):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups)
    return torch.optim.SGD(groups, momentum=0.9)


def lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def run_to(sched, step):
    """Step the scheduler until last_batch_iteration == step."""
    while sched.last_batch_iteration < step:
        sched.step()


ONE_CYCLE = {
    "cycle_min_lr": 0.001,
    "cycle_max_lr": 0.011,
    "cycle_first_step_size": 4,
    "cycle_second_step_size": 6,
    "decay_lr_rate": 0.5,
    "decay_step_size": 2,
    "cycle_min_mom": 0.8,
    "cycle_max_mom": 0.9,
    "decay_mom_rate": 0.01,
}

ALL = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 6}),
    ("WarmupDecayLR", {"total_num_steps": 15, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
    ("OneCycle", ONE_CYCLE),
]
