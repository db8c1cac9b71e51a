"""`deepspeed.runtime.fp16.loss_scaler`: DeepSpeed's constructors and attribute names over
zerotron's loss scaler (zerotron/precision.py), which implements DeepSpeed's algorithm."""

from __future__ import annotations

import math

import torch

from ....config import FP16Config
from ....precision import LossScaleAtMinimum
from ....precision import LossScaler as _ZerotronScaler

INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def to_python_float(t):
    return t.item() if hasattr(t, "item") else t[0]


class LossScalerBase(_ZerotronScaler):
    """DeepSpeed's names on zerotron's scaler: cur_scale (= scale), loss_scale, scale_loss, backward."""

    @property
    def cur_scale(self) -> float:
        return self.scale

    @cur_scale.setter
    def cur_scale(self, value):
        self.scale = float(value)

    @property
    def loss_scale(self) -> float:
        return self.scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.scale * g for g in grad_in)

    def scale_loss(self, loss):
        return loss * self.scale

    def backward(self, loss, retain_graph: bool = False):
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool):
        self.update(overflow)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not bool(torch.isfinite(x.float().sum()))

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad) for p in params)

    def has_overflow(self, params) -> bool:
        return self.dynamic and self.has_overflow_serial(params)


class LossScaler(LossScalerBase):
    """A static loss scale."""

    def __init__(self, scale=1):
        if not scale > 0:
            raise ValueError(f"a static loss scale must be positive, got {scale!r}")
        super().__init__(FP16Config(enabled=True, loss_scale=float(scale)))


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic scaler: halve on overflow (after `delayed_shift` overflows, the
    hysteresis), double after `scale_window` clean steps, never below `min_scale`."""

    def __init__(
        self,
        init_scale=2**32,
        scale_window=1000,
        min_scale=1,
        delayed_shift=1,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=True,
        dtype=torch.half,
    ):
        power = math.log2(init_scale) if init_scale > 0 else 0
        super().__init__(
            FP16Config(
                enabled=True,
                loss_scale=0.0,
                initial_scale_power=int(power),
                loss_scale_window=scale_window,
                hysteresis=delayed_shift,
                consecutive_hysteresis=consecutive_hysteresis,
                min_loss_scale=min_scale,
            )
        )
        self.scale = float(init_scale)
        self.scale_factor = 2.0  # zerotron's scaler halves and doubles
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dtype = dtype

    # DeepSpeed's attribute names for the state zerotron's scaler keeps
    cur_iter = property(lambda self: self.iteration, lambda self, v: setattr(self, "iteration", v))
    last_overflow_iter = property(lambda self: self.last_overflow, lambda self, v: setattr(self, "last_overflow", v))
    cur_hysteresis = property(lambda self: self.hysteresis_left, lambda self, v: setattr(self, "hysteresis_left", v))
    delayed_shift = property(lambda self: self.hysteresis, lambda self, v: setattr(self, "hysteresis", v))
    scale_window = property(lambda self: self.window, lambda self, v: setattr(self, "window", v))

    def update_scale(self, overflow: bool):
        try:
            self.update(overflow)
        except LossScaleAtMinimum:
            if self.raise_error_at_min_scale:
                raise
            self.last_overflow = self.iteration  # stay at the minimum, as DeepSpeed does
            self.iteration += 1


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args):
    """DeepSpeed's factory: a dynamic scaler for fp16 with dynamic scaling, else a static one (1 unless fp16)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("dynamic loss scaling needs its parameters (dynamic_loss_args)")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
