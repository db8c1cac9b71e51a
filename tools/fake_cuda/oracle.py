"""CUDA's rules for one operation, from torch's own meta kernels: run the operation on fake tensors that sit
where the real ones stand (torch's FakeTensorMode, which applies the device rules of CUDA's dispatch and the
output shapes, dtypes and layouts of CUDA's kernels), and read off what CUDA would do with it:

- refuse it (a host tensor meeting a device tensor, a dtype or shape CUDA's kernel does not take): `CudaRefusal`;
- produce outputs on these devices with these shapes and strides (`Verdict.outputs`);
- need values only the device has to know the output's size (`nonzero`, a boolean mask, `.item()`): on a GPU
  the host waits for the device there (`Verdict.sync`);
- nothing known (an operation without a meta kernel): `Verdict.unknown`, decided by the plain device rule."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_map

_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class _NoCudaBuild(Exception):
    pass


class CudaRefusal(RuntimeError):
    """CUDA would refuse this operation (the message is CUDA's, through its meta kernel)."""


class Out(NamedTuple):
    """An output as CUDA's kernel makes it."""

    device: torch.device
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype


@dataclass
class Verdict:
    outputs: list = field(default_factory=list)  # flat, as the op's outputs: an Out, or None for a non-tensor
    sync: bool = False
    unknown: bool = False


class Oracle:
    """Verdicts are remembered by operation and operand metadata: a training step repeats a few hundred
    distinct calls, and a remembered verdict costs a dictionary lookup instead of a fake dispatch."""

    def __init__(self):
        self.mode = FakeTensorMode(allow_fallback_kernels=False)
        self.mode.cache_enabled = False  # (its own cache, keyed by more than ours, only repeats our lookups)
        self.converter = self.mode.fake_tensor_converter
        self.verdicts: dict = {}

    def _fake(self, t: torch.Tensor, device: torch.device):
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return self.converter.from_meta_and_device(self.mode, meta, device)

    def judge(self, func, args, kwargs, device_of) -> Verdict:
        key = _key(func, args, kwargs, device_of)
        verdict = self.verdicts.get(key) if key is not None else None
        if verdict is None:
            verdict = self._judge(func, args, kwargs, device_of)
            if key is not None:
                self.verdicts[key] = verdict
        return verdict

    def _judge(self, func, args, kwargs, device_of) -> Verdict:
        try:
            return self._run_fake(func, args, kwargs, device_of)
        except _NoCudaBuild:
            pass
        # A meta kernel that needs CUDA's runtime itself (a boolean index's nonzero, on this CPU build):
        # CUDA's device rule by hand (one device, or host scalars beside it), the rest from host fakes.
        devices = {device_of(t) for t in leaves([args, kwargs]) if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1:
            raise CudaRefusal(
                f"{func}: Expected all tensors to be on the same device, but found {sorted(map(str, devices))}"
            )
        verdict = self._run_fake(func, args, kwargs, lambda t: torch.device("cpu"))
        device = next(iter(devices), None)
        if device is not None:
            verdict.outputs = [o._replace(device=device) if o is not None else None for o in verdict.outputs]
        return verdict

    def _run_fake(self, func, args, kwargs, device_of) -> Verdict:
        def fake(x):
            return self._fake(x, device_of(x)) if isinstance(x, torch.Tensor) else x

        fargs, fkwargs = tree_map(fake, args), tree_map(fake, kwargs)
        quiet, _LOG.disabled = _LOG.disabled, True  # (it logs every refusal as an error of its own)
        try:
            with self.mode:
                out = func(*fargs, **fkwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return Verdict(sync=True)
        except UnsupportedOperatorException:
            return Verdict(unknown=True)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            if "not linked with support for cuda" in str(e):
                raise _NoCudaBuild() from None
            raise CudaRefusal(f"{func}: {e}") from None
        finally:
            _LOG.disabled = quiet
        flat = list(leaves(out if isinstance(out, (list, tuple)) else [out]))
        return Verdict(
            outputs=[Out(o.device, o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else None for o in flat]
        )


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def leaves(value):
    """The leaves of an operator's arguments or results (tensors, numbers, ...): an ATen schema nests at
    most lists in the argument list (tree_flatten's generality costs more than the rest of a small op)."""
    if isinstance(value, dict):
        value = value.values()
    for x in value:
        if isinstance(x, (list, tuple)):
            yield from leaves(x)
        else:
            yield x


def _key(func, args, kwargs, device_of):
    """What decides the verdict: the operation, each tensor's metadata and device, every other argument's
    value and where it sits; None when an argument cannot be a key (a generator, a storage, a script object)."""
    parts = [func, tuple(kwargs)]
    for part in (args, kwargs.values()):
        for x in part:
            if isinstance(x, torch.Tensor):
                parts.append((x.shape, x.stride(), x.dtype, device_of(x)))
            elif isinstance(x, _PLAIN):
                parts.append((type(x), x))
            elif isinstance(x, (list, tuple)) and all(isinstance(y, (int, float, bool)) for y in x):
                parts.append((type(x), tuple(x)))
            elif isinstance(x, (list, tuple)) and all(isinstance(y, torch.Tensor) for y in x):
                parts.append(tuple((y.shape, y.stride(), y.dtype, device_of(y)) for y in x))
            else:
                return None
    return tuple(parts)
