"""What Python code sees of a tensor and asks of it by device, before torch's C++ (which sees host memory)
decides: a device tensor's `.device`, `.is_cuda`, `.get_device()`; "cuda" meaning the current device; `.to()`,
`.cpu()`, `.cuda()`, `type_as` as copies between host and device; `.tolist()` as the host sync it is; `.numpy()`
refused as CUDA refuses it; pinning; `torch.tensor(..., device="cuda")` made on the host and copied, as torch's
C++ does below the dispatcher's Python hook; one_hot as CUDA computes it. Installed on `torch.Tensor` and torch's
functions, so nested calls (hooks in backward, torch's own Python) see it too."""

from __future__ import annotations

import contextlib

import torch

from .placement import CPU, device_of, on_cuda
from .report import cuda_device, describe

aten = torch.ops.aten
_T = torch._C.TensorBase
_ONE_HOT = torch._C._nn.one_hot
_LIKE = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")
_MADE = ("tensor", "as_tensor", "asarray")


class TensorApi:
    def __init__(self, session):
        self.session = session

    def _device(self, value):
        return cuda_device(value, self.session.runtime.index)

    def patches(self) -> list:
        """(object, name, value) for patch.installed."""
        session = self.session

        def to(t, *args, **kwargs):  # (a function: a bound method set on a class would not bind the tensor)
            return self.to(t, *args, **kwargs)

        def device(t):
            try:
                return device_of(t)
            except RuntimeError:
                return _T.device.__get__(t)

        def cpu(t, memory_format=torch.preserve_format):
            return to(t, CPU, memory_format=memory_format) if on_cuda(t) else _T.cpu(t, memory_format=memory_format)

        def cuda(t, device=None, non_blocking=False, memory_format=torch.preserve_format):
            target = torch.device("cuda", session.runtime.index_of(device))
            return to(t, target, non_blocking=non_blocking, memory_format=memory_format)

        def tolist(t):
            if on_cuda(t):
                session.host_waits(f"tolist of {describe(t)}")
            return _T.tolist(t)

        def numpy(t, *, force=False):
            if on_cuda(t):
                raise TypeError(
                    f"can't convert {device_of(t)} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                    "to host memory first."
                )
            return _T.numpy(t, force=force)

        def new_tensor(t, data, dtype=None, device=None, requires_grad=False, **kwargs):
            device = self._device(device)
            return _T.new_tensor(t, data, dtype=dtype, device=device, requires_grad=requires_grad, **kwargs)

        def naming_the_host(original):
            """`original` said to name the host when its `device` argument does (see FakeCuda.host_asked)."""

            def call(*args, device=None, **kwargs):
                if device is not None and torch.device(self._device(device)).type == "cpu":
                    with session.host_asked():
                        return original(*args, device=device, **kwargs)
                return original(*args, device=device, **kwargs)

            return call

        def made(original):
            def make(*args, device=None, requires_grad=False, **kwargs):
                device = self._device(device)
                if device is None or torch.device(device).type != "cuda":
                    return original(*args, device=device, requires_grad=requires_grad, **kwargs)
                host = original(*args, **kwargs)
                return to(host, device, copy=host.device.type == "cuda").requires_grad_(requires_grad)

            return make

        def one_hot(t, num_classes=-1):
            """A C++ composite that branches on the device: the CPU branch reads the minimum and maximum on the
            host, CUDA's leaves the range check to the scatter's device assert."""
            if not on_cuda(t):
                return _ONE_HOT(t, num_classes)
            if num_classes == -1:
                num_classes = int(t.max()) + 1  # (a host sync, on a GPU too)
            out = torch.zeros(*t.shape, num_classes, dtype=torch.long, device=device_of(t))
            return out.scatter_(-1, t.unsqueeze(-1), 1)

        return [
            (torch.nn.functional, "one_hot", one_hot),
            (torch._C._nn, "one_hot", one_hot),
            (torch.Tensor, "device", property(device)),
            (torch.Tensor, "is_cuda", property(on_cuda)),
            (torch.Tensor, "is_cpu", property(lambda t: device_of(t).type == "cpu")),
            (torch.Tensor, "get_device", lambda t: device_of(t).index if on_cuda(t) else -1),
            (torch.Tensor, "to", to),
            (torch.Tensor, "cpu", cpu),
            (torch.Tensor, "cuda", cuda),
            (torch.Tensor, "type_as", lambda t, other: to(t, other)),
            (torch.Tensor, "tolist", tolist),
            (torch.Tensor, "numpy", numpy),
            (torch.Tensor, "new_tensor", new_tensor),
            (torch.Tensor, "pin_memory", lambda t, device=None: aten._pin_memory.default(t)),
            (torch.Tensor, "is_pinned", lambda t, device=None: session.memory.is_pinned(t)),
            (torch.Tensor, "record_stream", lambda t, stream: None),
            *((torch, name, made(getattr(torch, name))) for name in _MADE),
            *((torch, name, naming_the_host(getattr(torch, name))) for name in _LIKE),
            *((torch.Tensor, name, naming_the_host(getattr(_T, name))) for name in _NEW),
        ]

    def to(self, t, *args, **kwargs):
        """Tensor.to, every overload: a copy to another device through aten._to_copy, never torch's C++ `to`
        (which would name the host as the device); the same tensor when nothing changes, as torch's rule."""
        copy = kwargs.pop("copy", False)
        args = tuple(map(self._device, args))
        if "device" in kwargs:
            kwargs["device"] = self._device(kwargs["device"])
        if args and isinstance(args[0], torch.Tensor):  # to(other, non_blocking=False, copy=False)
            device, dtype, memory_format = device_of(args[0]), args[0].dtype, None
            non_blocking = bool(args[1]) if len(args) > 1 else kwargs.get("non_blocking", False)
        else:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        source = device_of(t)
        target = source if device is None else torch.device(self._device(device))
        memory_format = memory_format or torch.preserve_format
        laid_out = memory_format == torch.preserve_format or t.is_contiguous(memory_format=memory_format)
        if target == source and not copy and (dtype is None or dtype == t.dtype) and laid_out:
            return t
        moved = {} if target == source else {"device": target}
        with self.session.host_asked() if target.type == "cpu" else contextlib.nullcontext():
            return aten._to_copy.default(
                t, dtype=dtype or t.dtype, non_blocking=non_blocking, memory_format=memory_format, **moved
            )
