"""DeepSpeed's flops profiler (`deepspeed.profiling.flops_profiler`) on torch's own FLOP counting.

    prof = FlopsProfiler(model)          # or get_model_profile(model, input_shape=(8, 3, 32, 32))
    prof.start_profile()
    loss = model(batch)                  # only forward passes of `model` are counted
    prof.stop_profile()
    prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params(), prof.get_total_duration()
    prof.print_model_profile(profile_step=5)
    prof.end_profile()

FLOPs are torch.utils.flop_counter's: its formulas for matrix products, convolutions and attention
(elementwise operations, norms and activations count as none, as in the 6N + 12·L·d·s formula), and
MACs are half of them (every operation torch counts is a multiply-accumulate). Each module's FLOPs
and latency are measured between its own forward hooks, so they include its submodules', and only
forward passes count (DeepSpeed's rule: a backward is estimated as twice the forward).
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    print_aggregated,
    print_profile,
)

__all__ = [
    "FlopsProfiler",
    "get_model_profile",
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "params_to_string",
    "duration_to_string",
    "get_module_flops",
    "get_module_macs",
    "get_module_duration",
]

_aten = torch.ops.aten


# torch counts scaled_dot_product_attention's CUDA kernels but not the one it runs on CPUs: that
# kernel takes the same query/key/value, so torch's own attention formula counts it here.
def _attention_flops(*args, **kwargs):
    return flop_registry[_aten._scaled_dot_product_flash_attention](*args, **kwargs)


_attention_flops._get_raw = True  # given the tensors as they are (the registered formula reads their shapes)
_CPU_ATTENTION = {
    op: _attention_flops
    for op in (getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),)
    if op is not None
}


# module -> the profiler measuring it, for get_module_flops(module) and friends (DeepSpeed's functions of
# a module alone, which read what its profiler attached to it)
_measured_by: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _synchronize():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _numel(p: torch.Tensor) -> int:
    return getattr(p, "ds_numel", p.numel())  # a ZeRO-3 parameter's whole size, not this rank's piece


class FlopsProfiler:
    """FLOPs, MACs, parameters and forward latency of `model` and of each of its modules, measured
    on the forward passes between start_profile() and stop_profile(). `ds_engine`: the engine that
    trains it (its parallel sizes and micro-batch are printed with the profile)."""

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model, self.ds_engine, self.recompute_fwd_factor = model, ds_engine, recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._hooks: list = []
        self.reset_profile()

    # ---- measuring ---------------------------------------------------------------------------
    def start_profile(self, ignore_list=None):
        """Count from now on. `ignore_list`: module types left out of the per-module profile (their
        FLOPs still count in the modules around them)."""
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))
        for module in self.model.modules():
            _measured_by[module] = self
        self._counter = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)
        self._counter.__enter__()
        # The first operation under a dispatch mode loads torch's compiler machinery (seconds, once per
        # process): here, outside every module's timing.
        torch.mm(torch.zeros(1, 1), torch.zeros(1, 1))
        self.started = True

    def stop_profile(self):
        """Stop counting; what was measured stays readable until end_profile()."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def reset_profile(self):
        self._flops: dict[nn.Module, int] = {}
        self._duration: dict[nn.Module, float] = {}
        self._open: dict[nn.Module, list] = {}  # module -> its running calls' (flops, time) at entry

    def end_profile(self):
        """Stop and forget the measurements."""
        self.stop_profile()
        self.reset_profile()
        self.started = False
        for module in self.model.modules():
            if _measured_by.get(module) is self:
                del _measured_by[module]

    def _enter(self, module, args):
        _synchronize()
        self._open.setdefault(module, []).append((self._counter.get_total_flops(), time.perf_counter()))

    def _leave(self, module, args, output):
        if not self._open.get(module):  # started inside this module's forward
            return
        _synchronize()
        flops, start = self._open[module].pop()
        if self._open[module]:  # a recursive call: the outermost one counts the whole
            return
        self._flops[module] = self._flops.get(module, 0) + self._counter.get_total_flops() - flops
        self._duration[module] = self._duration.get(module, 0.0) + time.perf_counter() - start

    # ---- reading -----------------------------------------------------------------------------
    def module_flops(self, module: nn.Module) -> int:
        """FLOPs of `module`'s forward passes, its submodules' included (an ignored module: its children's)."""
        if module in self._flops or module in self._open:
            return self._flops.get(module, 0)
        return sum(self.module_flops(c) for c in module.children())

    def module_duration(self, module: nn.Module) -> float:
        """Seconds in `module`'s forward passes (a container never called itself: its children's)."""
        if module in self._duration:
            return self._duration[module]
        return sum(self.module_duration(c) for c in module.children())

    @staticmethod
    def module_params(module: nn.Module) -> int:
        return sum(_numel(p) for p in module.parameters())

    def get_total_flops(self, as_string: bool = False):
        flops = self.module_flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self.get_total_flops() // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False):
        """Parameters of the model on this rank (a tensor-parallel rank's shards; ZeRO-3's whole parameters)."""
        params = self.module_params(self.model)
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False):
        seconds = self.module_duration(self.model)
        return duration_to_string(seconds) if as_string else seconds

    # ---- printing (report.py) ----------------------------------------------------------------
    def print_model_profile(self, profile_step=1, module_depth=-1, top_modules=1, detailed=True, output_file=None):
        """The profile: totals, the top modules by parameters, MACs and latency at each depth (down to
        `module_depth`, -1: all), and with `detailed` the model's tree with each module's numbers; to
        stdout, or to `output_file`. Nothing when not started (as DeepSpeed)."""
        if self.started:
            print_profile(self, profile_step, module_depth, top_modules, detailed, output_file)

    def print_model_aggregated_profile(self, module_depth=-1, top_modules=1):
        print_aggregated(self, module_depth, top_modules)


def _profiler_of(module: nn.Module) -> FlopsProfiler:
    prof = _measured_by.get(module)
    if prof is None:
        raise RuntimeError(
            f"no flops profile of this {type(module).__name__}: call it between FlopsProfiler(model).start_profile() "
            "and end_profile() of a model that contains it"
        )
    return prof


def get_module_flops(module: nn.Module) -> int:
    return _profiler_of(module).module_flops(module)


def get_module_macs(module: nn.Module) -> int:
    return get_module_flops(module) // 2


def get_module_duration(module: nn.Module) -> float:
    return _profiler_of(module).module_duration(module)


def get_model_profile(
    model: nn.Module,
    input_shape: tuple | None = None,
    args=None,
    kwargs=None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules=None,
    mode: str = "forward",
):
    """(flops, macs, params) of one forward pass of `model` (in eval mode) on `input_shape` (a tensor
    of that shape, the model's dtype and device: an image batch; use `args`/`kwargs` for token ids),
    after `warm_up` unmeasured passes; as strings with `as_string`. `mode="generate"` profiles
    model.generate(...) instead."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile needs a torch.nn.Module, not {type(model).__name__}")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape must be a non-empty tuple, e.g. (8, 3, 224, 224), not {input_shape!r}")
        first = next(model.parameters(), None)
        like = {} if first is None else {"dtype": first.dtype, "device": first.device}
        args = [torch.ones(input_shape, **like)]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, or the model's inputs as args and/or kwargs")
    if mode not in ("forward", "generate"):
        raise ValueError(f'mode must be "forward" or "generate", not {mode!r}')
    run = model if mode == "forward" else model.generate
    model.eval()
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
        finally:
            prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
