"""DeepSpeed's learning-rate schedulers: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle.

Names, JSON parameters, defaults and step-by-step values follow
``deepspeed.runtime.lr_schedules`` so a DeepSpeed config's "scheduler" block runs unchanged.

Every scheduler counts optimizer steps in ``last_batch_iteration``: -1 means "not started",
and ``step()`` advances it and writes that step's lr into every param group. The engine
calls ``step()`` once per optimizer step, after ``optimizer.step()``.
"""

import logging
import math

import torch

from .config.scheduler_section import (
    DEFAULT_WARMUP_STEPS,
    LOG,
    SCHEDULER_TYPES,  # noqa: F401 (public here)
    WARMUP_TYPES,
    is_auto,
    validate_scheduler,
)
from .errors import ConfigError

logger = logging.getLogger(__name__)

# DeepSpeed's OneCycle writes betas = (momentum, 0.99), replacing whatever beta2 the optimizer had.
# Kept so a OneCycle run gives the same Adam updates as under DeepSpeed.
ONE_CYCLE_BETA2 = 0.99


def torch_optimizer(optimizer):
    # Engines may hand us a wrapper (loss scaler, ZeRO); the lr lives in the inner torch optimizer.
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} has no param_groups: pass a torch.optim.Optimizer")


def per_group(optimizer, value, name):
    """One value per param group: a scalar is shared, a list must have one entry per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(
                f"scheduler.params.{name}", value, f"give a single number or a list of {n} (one per param group)"
            )
        return list(value)
    return [value] * n


def write_groups(param_groups, key, values):
    """Store one value per group under `key`; return what the groups now hold."""
    for group, value in zip(param_groups, values):
        if torch.is_tensor(group.get(key)):
            # Fill in place: a tensor lr is shared with compiled/capturable optimizer steps.
            group[key].fill_(value)
        else:
            group[key] = value
    return [group[key] for group in param_groups]


class Scheduler:
    """Step counter and checkpoint state; a subclass only says what lr a step gets (get_lr)."""

    def __init__(self, optimizer, last_batch_iteration=-1):
        self.optimizer = torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def get_lr(self):
        """The lr of each param group at step `last_batch_iteration`."""
        raise NotImplementedError

    def step(self, last_batch_iteration=None):
        # An explicit index lets a caller jump straight to a step (resume, pipeline engines).
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _apply(self):
        self._last_lr = write_groups(self.optimizer.param_groups, "lr", self.get_lr())

    def get_last_lr(self):
        if self._last_lr is None:
            raise RuntimeError("no lr applied yet: call step() first")
        return self._last_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        # The lr reaches the optimizer at the next step(), as in DeepSpeed.
        self.last_batch_iteration = state["last_batch_iteration"]


class _WarmupScheduler(Scheduler):
    """Shared warmup: the fraction 0..1 of warmup done at the current step, log or linear."""

    def __init__(self, optimizer, warmup_num_steps, warmup_type, last_batch_iteration):
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
            raise ValueError(f"warmup_num_steps must be an integer >= 0, got {warmup_num_steps!r}")
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        super().__init__(optimizer, last_batch_iteration)
        # At least 2: log warmup divides by log(warmup_num_steps), and log(1) is 0.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)

    def _in_warmup(self):
        return self.last_batch_iteration < self.warmup_num_steps

    def _warmup_fraction(self):
        if self.warmup_type == LOG:
            # log(step + 1) / log(W): 0 at step 0, 1 at step W - 1 (linear gets there at step W).
            return self._inverse_log_warmup * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _start(self):
        # A fresh run (not a resume) puts the step -1 lr into the optimizer straight away.
        if self.last_batch_iteration == -1:
            self._apply()


class WarmupLR(_WarmupScheduler):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold warmup_max_lr.

    warmup_max_lr=None (the default) takes each param group's lr at construction.
    """

    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps=DEFAULT_WARMUP_STEPS,
        warmup_type=LOG,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self._start()

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _gamma(self):
        """How far from warmup_min_lr (0) to warmup_max_lr (1) the current step is."""
        return self._warmup_fraction() if self._in_warmup() else 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr back to warmup_min_lr at step
    total_num_steps, held there afterwards. Unlike WarmupLR, warmup_max_lr defaults to 0.001."""

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=DEFAULT_WARMUP_STEPS,
        warmup_type=LOG,
        last_batch_iteration=-1,
    ):
        self.total_num_steps = total_num_steps  # set first: the base class applies the step -1 lr
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self):
        if self._in_warmup():
            return self._warmup_fraction()
        decay_steps = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) / decay_steps)


class WarmupCosineLR(_WarmupScheduler):
    """Scale each group's own lr: warm the ratio up from warmup_min_ratio to 1, then cosine-decay
    it to cos_min_ratio at step total_num_steps - 1 and hold it there.

    The base lrs are the param groups' lrs at construction, so build this before loading an
    optimizer checkpoint (whose lrs are already scaled).
    """

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_ratio=0.0,
        warmup_num_steps=DEFAULT_WARMUP_STEPS,
        cos_min_ratio=0.0001,
        warmup_type=LOG,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0  # DeepSpeed starts from lr 0, not warmup_min_ratio
        if self._in_warmup():
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction()
        # The first step after warmup is already one step into the cosine; progress is clamped
        # so the ratio stays at cos_min_ratio past the end instead of rising again.
        steps_into_decay = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, steps_into_decay / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self):
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]


class OneCycle(Scheduler):
    """1Cycle: lr climbs cycle_min_lr -> cycle_max_lr over cycle_first_step_size steps, falls back
    over cycle_second_step_size steps, then decays as cycle_min_lr / (1 + decay_lr_rate * t) with
    t = steps after the cycle / decay_step_size (not rounded). Momentum (betas[0], for optimizers
    that have betas) moves the opposite way between cycle_max_mom and cycle_min_mom, and after the
    cycle becomes cycle_max_mom * (1 + decay_mom_rate * t).
    """

    def __init__(
        self,
        optimizer,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )

        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        # A zero decay_step_size or rate means "no decay": values then stay at their cycle end.
        no_decay_steps = math.isclose(decay_step_size, 0)
        self._lr_decays = not (no_decay_steps or math.isclose(decay_lr_rate, 0))
        self._mom_decays = not (no_decay_steps or math.isclose(decay_mom_rate, 0))

        # Only Adam-style betas are cycled; SGD's `momentum` is left alone, as in DeepSpeed.
        self.cycle_momentum = cycle_momentum and "betas" in getattr(self.optimizer, "defaults", {})
        if cycle_momentum and not self.cycle_momentum:
            logger.warning("OneCycle: %s has no betas, so momentum is not cycled", type(self.optimizer).__name__)
        if self.cycle_momentum:
            self.min_moms = per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")

        if last_batch_iteration == -1:
            # A fresh run starts at the low ends (cycle_min_lr, cycle_min_mom). get_last_lr()
            # still needs a step(), as in DeepSpeed.
            write_groups(self.optimizer.param_groups, "lr", self.min_lrs)
            if self.cycle_momentum:
                write_groups(
                    self.optimizer.param_groups, "betas", [(beta1, ONE_CYCLE_BETA2) for beta1 in self.min_moms]
                )

    def _cycle_position(self):
        """0 at cycle_min_lr, 1 at cycle_max_lr. Step i is placed at batch i + 1 of the cycle."""
        offset = (self.last_batch_iteration + 1) % self.total_size
        if offset <= self.first_step_size:
            climbed, half, stairs = offset, self.first_step_size, self.first_stair_count
        else:
            climbed, half, stairs = self.total_size - offset, self.second_step_size, self.second_stair_count
        if stairs > 0:
            # Staircase: hold flat for half/stairs steps at a time. Floor the integer step ratio,
            # not a float fraction, so an exact stair boundary can't round down a whole stair.
            return math.floor(climbed * stairs / half) / stairs
        return climbed / half

    def _decay_intervals(self):
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _in_cycle(self):
        return self.last_batch_iteration < self.total_size

    def get_lr(self):
        if self._in_cycle():
            position = self._cycle_position()
            return [lo + (hi - lo) * position for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if not self._lr_decays:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_intervals()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self):
        """Betas (beta1, 0.99) per group for the current step, or None when momentum isn't cycled."""
        if not self.cycle_momentum:
            return None
        if self._in_cycle():
            position = self._cycle_position()
            beta1s = [hi - (hi - lo) * position for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self._mom_decays:
            factor = 1 + self.decay_mom_rate * self._decay_intervals()
            beta1s = [hi * factor for hi in self.max_moms]
        else:
            beta1s = list(self.max_moms)
        return [(beta1, ONE_CYCLE_BETA2) for beta1 in beta1s]

    def _apply(self):
        super()._apply()
        if self.cycle_momentum:
            write_groups(self.optimizer.param_groups, "betas", self.get_mom())


class LRRangeTest(Scheduler):
    """The learning-rate range test: lr = lr_range_test_min_lr * (1 + step_rate * t), with
    t = (step + 1) / step_size (rounded down with `lr_range_test_staircase`). The min lr is in the
    optimizer from construction on."""

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        if (
            isinstance(lr_range_test_step_size, bool)
            or not isinstance(lr_range_test_step_size, int)
            or lr_range_test_step_size <= 0
        ):
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = write_groups(self.optimizer.param_groups, "lr", self.min_lr)

    def _interval(self) -> float:
        t = (self.last_batch_iteration + 1) / self.step_size
        return math.floor(t) if self.staircase else t

    def get_lr(self):
        factor = 1 + self.step_rate * self._interval()
        return [lr * factor for lr in self.min_lr]


SCHEDULERS = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
assert tuple(SCHEDULERS) == SCHEDULER_TYPES, "the config's scheduler types and the schedulers built here differ"


def build_scheduler(type_name: str, params: dict, optimizer):
    """Validate a scheduler block and construct it on `optimizer` (lrs take effect at once)."""
    params = {} if params is None else params
    validate_scheduler(type_name, params)
    for name, value in params.items():
        if is_auto(value):
            raise ConfigError(
                f"scheduler.params.{name}", value, "resolve 'auto' to a value before building the scheduler"
            )
    return SCHEDULERS[type_name](optimizer, **params)
