"""Where memory lives under fake CUDA. A tensor's device is its storage's, as on a GPU, where the device
belongs to the allocation: views, `param.data = ...` and `set_` follow it without further work. The data
itself is in host memory (a CPU-only build has no other); the storage carries the device it stands for.

Host memory can be page-locked (pinned) twice over, as on a GPU: by torch's pinned allocator (`pin_memory=True`,
`Tensor.pin_memory()`), marked on the storage, or by `cudaHostRegister` on an address range."""

from __future__ import annotations

import bisect
import weakref

import torch

CPU = torch.device("cpu")
_DEVICE = "_fake_cuda_device"
_PINNED = "_fake_cuda_pinned"


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, a subclass without storage
        return None


_real_device = torch._C.TensorBase.device.__get__


def device_of(t: torch.Tensor) -> torch.device:
    """The device `t` stands on: the one its storage was placed on, else its real one."""
    s = _storage(t)
    device = getattr(s, _DEVICE, None) if s is not None else None
    return device if device is not None else _real_device(t)


def on_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and device_of(t).type == "cuda"


class Memory:
    """The device memory in use (the storages placed on a device) and the host memory page-locked."""

    def __init__(self):
        self.storages: weakref.WeakSet = weakref.WeakSet()
        self.placed = 0  # bytes placed and not yet freed, counted at placement (a later resize is not seen)
        self.peak = 0  # the most `placed` reached
        self._ranges: list[tuple[int, int]] = []  # registered (start, end), sorted

    def place(self, t: torch.Tensor, device: torch.device) -> None:
        s = _storage(t)
        if s is None or _real_device(t).type != "cpu" or getattr(s, _DEVICE, None) == device:
            return
        setattr(s, _DEVICE, device)
        self.storages.add(s)
        nbytes = s.nbytes()
        self.placed += nbytes
        self.peak = max(self.peak, self.placed)
        weakref.finalize(s, self._freed, nbytes)

    def _freed(self, nbytes: int) -> None:
        self.placed -= nbytes

    def allocated(self) -> int:
        """The bytes of the device's storages now (their sizes now: ZeRO-3's released buffers count 0)."""
        return sum(s.nbytes() for s in list(self.storages))

    # ---- page-locked host memory ----
    def pin(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is not None:
            setattr(s, _PINNED, True)

    def register(self, address: int, nbytes: int) -> None:
        bisect.insort(self._ranges, (address, address + nbytes))

    def unregister(self, address: int) -> bool:
        for i, (start, _) in enumerate(self._ranges):
            if start == address:
                del self._ranges[i]
                return True
        return False

    def is_pinned(self, t: torch.Tensor) -> bool:
        s = _storage(t)
        if s is None or on_cuda(t):
            return False
        if getattr(s, _PINNED, False):
            return True
        address = s.data_ptr()
        i = bisect.bisect_right(self._ranges, (address, float("inf"))) - 1
        return i >= 0 and self._ranges[i][0] <= address < self._ranges[i][1]
