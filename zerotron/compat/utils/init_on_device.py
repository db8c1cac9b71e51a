"""DeepSpeed's `OnDevice`: build a model's tensors straight on a device and in a dtype.

with OnDevice(dtype=torch.bfloat16, device="meta"):
    model = MyModel()        # every floating-point parameter: meta, bf16; nothing allocated
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.empty_strided}


class _CastFactories(TorchFunctionMode):
    """Floating-point results of tensor factories come out in `dtype`."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FACTORIES and torch.is_tensor(out) and out.is_floating_point() and out.dtype != self.dtype:
            out = out.to(self.dtype)
        return out


class OnDevice:
    """Inside the block, tensors are created on `device` (default "meta") and floating-point ones
    in `dtype` (None: as asked). `enabled=False` makes it a plain block."""

    def __init__(self, dtype=None, device="meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._modes = []

    def __enter__(self):
        if self.enabled:
            self._modes = [self.device] + ([_CastFactories(self.dtype)] if self.dtype is not None else [])
            for mode in self._modes:
                mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        return False
