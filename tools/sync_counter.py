"""SyncCounter: the calls that would make the host wait for a GPU, counted on any device.

Tests (tests/test_gpu_semantics.py, tests/test_offload_transfers.py) and the GPU runbook's `correct` part
(tools/gpu/checks.py) count with it.
"""

from __future__ import annotations

import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode

_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
}


_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.stack,
    torch.cat,
}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


class SyncCounter(TorchFunctionMode):
    """Counts the calls that make the host wait for the device, each with the zerotron line it came
    from: on a CPU, where nothing has to wait, this is how a test sees the syncs a GPU would pay for.
    - reads of device values (.item(), .tolist(), bool(t), ...);
    - copies to the device from pageable host memory, which drain the stream before they start:
      `torch.tensor(data, device=...)` (Python data goes through a host tensor), and a tensor made on
      the host (a factory without a device, or what is computed from one) moved or copied to a
      device. Host buffers made on purpose (zerotron.comm.host_buffer: offload, staging) are
      page-locked on a GPU and do not count; nor does pinned memory."""

    def __init__(self):
        super().__init__()
        self.where = []
        self._host_born: set[int] = (
            set()
        )  # ids of live tensors made on the host (not a WeakSet: tensors compare elementwise)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS or self._pageable_upload(func, args, kwargs):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/zerotron/" in f.filename), None)
            self.where.append(
                f"{func.__name__} at {frame.filename.rsplit('/zerotron/', 1)[-1]}:{frame.lineno}"
                if frame
                else func.__name__
            )
        out = func(*args, **kwargs)
        if torch.is_tensor(out) and id(out) not in self._host_born and self._made_on_host(func, args, kwargs):
            self._host_born.add(id(out))
            weakref.finalize(out, self._host_born.discard, id(out))
        return out

    def _on_host(self, t) -> bool:
        return id(t) in self._host_born

    def _made_on_host(self, func, args, kwargs) -> bool:
        if func in _FACTORIES or func in _FROM_DATA:
            return kwargs.get("device") is None and not (
                func in _FACTORIES and any(not self._on_host(a) for a in _tensors(args))
            )
        return func not in _MOVES and any(self._on_host(a) for a in _tensors(args))

    def _pageable_upload(self, func, args, kwargs) -> bool:
        if func in _FROM_DATA:
            return kwargs.get("device") is not None and not torch.is_tensor(args[0] if args else None)
        if func not in _MOVES or not args:
            return False
        from zerotron.comm import HostTensor

        source = args[1] if func is torch.Tensor.copy_ else args[0]
        if (
            not torch.is_tensor(source)
            or not self._on_host(source)
            or isinstance(source, HostTensor)
            or source.is_pinned()
        ):
            return False
        if func is torch.Tensor.copy_:
            return not self._on_host(args[0])
        return (
            func is torch.Tensor.cuda
            or kwargs.get("device") is not None
            or any(isinstance(a, (torch.device, str)) for a in args[1:])
        )


def _tensors(args):
    for a in args:
        if torch.is_tensor(a):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if torch.is_tensor(t))
