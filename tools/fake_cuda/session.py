"""The fake-CUDA session: torch's "cuda" device on a machine without one, with CUDA's rules.

Inside `with FakeCuda():` a process sees a GPU (`torch.cuda.is_available()`, `torch.device("cuda")`, streams,
events, pinned memory, NCCL's group through `init_process_group("fake_nccl")`: collectives.py), and every
operation on a device tensor goes through two steps:

1. CUDA's rules, from torch's own meta kernels (oracle.py): a host tensor meeting a device tensor is refused as
   CUDA refuses it; outputs get the shapes, dtypes and layouts CUDA's kernels give them; an operation whose
   output size depends on device values (`.item()`, `nonzero`, a boolean mask) is a host sync, counted;
2. the values, from torch's CPU kernels on the host data (or, for CUDA-only kernels, stand-ins with CUDA's
   contract: kernels.py), so the step trains for real and its losses can be compared with a CPU run.

Copies between host and device are classified as CUDA does them (transfers.py); Python's view of tensors and
devices is tensor_api.py's; `torch.cuda` is runtime.py's. `torch.cuda.synchronize()` waits for every
collective and receive this rank has posted, as it would on a GPU (where that includes the receives a pipeline
posts ahead), and says so if they do not complete.

What it does not see: races between streams (work runs in issue order), kernels' numerical differences (TF32,
reduction orders), memory limits, NCCL's own behaviour beyond its tensor rules.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .collectives import Collectives, register_backend
from .kernels import OWN_RULES, STAND_INS
from .oracle import CudaRefusal, Oracle, leaves
from .patch import installed
from .placement import CPU, Memory, device_of, on_cuda
from .report import FakeCudaError, Sync, cuda_device, describe, refused, where
from .runtime import Runtime
from .tensor_api import TensorApi
from .transfers import SPECIAL

_CURRENT: list = []


class FakeCuda:
    """One process's fake GPU(s): `device_count` devices, this process on `index` (a rank's LOCAL_RANK)."""

    def __init__(self, device_count: int = 1, index: int = 0, sync_wait_s: float = 10.0):
        self.memory = Memory()
        self.runtime = Runtime(self, device_count, index)
        self.oracle = Oracle()
        self.collectives = Collectives(self.runtime)
        self.syncs: list[Sync] = []
        self.staged: list[Sync] = []  # non-blocking uploads from pageable memory: the driver stages them
        self.unchecked: set[str] = set()  # operations without a meta kernel: only the device rule was applied
        self.sync_wait_s = sync_wait_s
        self._stack: contextlib.ExitStack | None = None
        self._generator_args: dict = {}
        self._host_asked = 0  # inside a Python call that names the host as the device (see host_asked)
        self._lock = threading.RLock()  # (threads share the oracle)

    @staticmethod
    def current() -> "FakeCuda | None":
        """The session this process is in (None outside one)."""
        return _CURRENT[-1] if _CURRENT else None

    # ---- entering and leaving -------------------------------------------------------------------------
    def __enter__(self) -> "FakeCuda":
        register_backend()
        _CURRENT.append(self)
        patches = [
            *TensorApi(self).patches(),
            (dist.distributed_c10d, "_get_object_coll_device", lambda group=None: "cuda"),  # (NCCL's group)
            (dist.distributed_c10d.Work, "wait", self.collectives.waiting()),
            (threading.Thread, "run", self._in_threads(threading.Thread.run)),
        ]
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.runtime.installed())
        self._stack.enter_context(installed(patches))
        self._stack.enter_context(_Kernels(self))
        return self

    def __exit__(self, *exc) -> bool:
        stack, self._stack = self._stack, None
        stack.close()
        _CURRENT.remove(self)
        return False

    def _in_threads(self, run):
        """A thread started in the session runs in it too (torch's dispatch modes are per thread)."""

        def run_in_session(thread):
            with _Kernels(self):
                return run(thread)

        return run_in_session

    # ---- host syncs -------------------------------------------------------------------------------------
    def host_waits(self, what: str, device_wide: bool = False) -> None:
        """The host waits for the device here: for the current stream's work, or with `device_wide`
        (torch.cuda.synchronize) for everything queued on the device, the collectives and receives posted on
        NCCL's streams included. torch.cuda.set_sync_debug_mode's "warn" and "error" apply."""
        self.syncs.append(Sync(what, where()))
        mode = self.runtime.sync_debug_mode
        if mode == 2:
            raise RuntimeError(f"called a synchronizing CUDA operation ({what})")
        if mode == 1:
            warnings.warn(f"called a synchronizing CUDA operation ({what})", stacklevel=2)
        if device_wide:
            self.collectives.drain(what, self.sync_wait_s)

    def take_syncs(self) -> list[Sync]:
        """The host syncs since the last call (and forget the staged uploads too)."""
        syncs, self.syncs, self.staged = self.syncs, [], []
        return syncs

    # ---- one operation ----------------------------------------------------------------------------------
    def run(self, func, args, kwargs):
        if func.namespace == "c10d":
            return self.collectives.run(func, args, kwargs)
        special = SPECIAL.get(func)
        if special is not None:
            return special(self, func, args, kwargs)
        tensors = [x for part in (args, kwargs) for x in leaves(part) if isinstance(x, torch.Tensor)]
        kwargs = self.device_kwarg(kwargs, tensors)
        target = kwargs.get("device")
        if not (target is not None and torch.device(target).type == "cuda") and not any(map(on_cuda, tensors)):
            return self.on_host(func, args, kwargs)
        return self.on_device(func, args, kwargs, tensors)

    @contextlib.contextmanager
    def host_asked(self):
        """Python code names the host as the device (`.cpu()`, `zeros_like(t, device="cpu")`): a host device
        argument met outside such a call is torch's C++ passing on an operand's options (`type_as` in a
        composite such as rms_norm), which here name the host memory the data is in, not the device."""
        self._host_asked += 1
        try:
            yield
        finally:
            self._host_asked -= 1

    def device_kwarg(self, kwargs, tensors) -> dict:
        device = kwargs.get("device")
        if device is None or self._host_asked or torch.device(device).type != "cpu":
            return kwargs
        placed = next((device_of(t) for t in tensors if on_cuda(t)), None)
        return kwargs if placed is None else {**kwargs, "device": placed}

    def on_host(self, func, args, kwargs):
        if not kwargs.get("pin_memory"):
            return func(*args, **kwargs)
        out = func(*args, **{**kwargs, "pin_memory": False})
        for t in leaves([out]):
            if isinstance(t, torch.Tensor):
                self.memory.pin(t)
        return out

    def judge(self, func, args, kwargs, tensors):
        try:
            with self._lock:
                return self.oracle.judge(func, args, kwargs, device_of)
        except CudaRefusal as e:
            raise refused(e, tensors) from None

    def on_device(self, func, args, kwargs, tensors):
        self.launch_check(func)
        if func in OWN_RULES:
            return self._own_rules(func, args, kwargs, tensors)
        verdict = self.judge(func, args, kwargs, tensors)
        if verdict.sync:
            self.host_waits(str(func))
        out = self._kernel(func, args, self.host_kwargs(func, kwargs), tensors)
        if verdict.outputs:
            return self._as_cuda_gives(func, out, verdict.outputs, tensors)
        devices = {device_of(t) for t in tensors if t.dim() > 0 or not on_cuda(t)} - {CPU}
        if kwargs.get("device") is not None:
            devices.add(cuda_device(kwargs["device"], self.runtime.index))
        if verdict.unknown:
            self.unchecked.add(str(func))
            if len(devices) > 1 or (CPU in {device_of(t) for t in tensors if t.dim() > 0} and devices):
                raise refused(f"{func} (no meta kernel) mixes devices", tensors)
        self._place(out, next(iter(devices)) if devices else torch.device("cuda", self.runtime.index))
        return out

    def _own_rules(self, func, args, kwargs, tensors):
        """A stand-in that checks CUDA's rules itself: the device rule here, then its values and syncs."""
        devices = {device_of(t) for t in tensors}
        if len(devices) > 1:
            raise refused(f"{func} mixes devices", tensors)
        why = OWN_RULES[func](*args, **kwargs)
        if why:
            self.host_waits(why)
        out = self._kernel(func, args, kwargs, tensors)
        self._place(out, next(iter(devices)))
        return out

    def _place(self, out, device) -> None:
        for t in leaves([out]):
            if isinstance(t, torch.Tensor):
                self.memory.place(t, device)

    def _kernel(self, func, args, kwargs, tensors):
        """The values: the stand-in of a CUDA-only kernel (whose own checks are CUDA's), or the host's kernel."""
        stand_in = STAND_INS.get(func)
        if stand_in is None:
            return func(*args, **kwargs)
        try:
            return stand_in(*args, **kwargs)
        except RuntimeError as e:
            raise refused(f"{func}: {e}", tensors) from None

    def launch_check(self, func) -> None:
        """CUDA reports a failed runtime call's error at the next kernel launch's check, as that kernel's."""
        error = self.runtime.last_error
        if error:
            self.runtime.last_error = 0
            raise FakeCudaError(
                f"CUDA error: {self.runtime.cudart.cudaGetErrorString(error)} (reported by {func} at {where()}; "
                "left set by an earlier CUDA runtime call that failed and whose error nobody took with "
                "cudaGetLastError)"
            )

    def host_kwargs(self, func, kwargs) -> dict:
        """The keyword arguments for the host's kernel: the host for the device, no pinning, the fake GPU's
        random generator for its random operations."""
        kwargs = dict(kwargs)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if self._takes_generator(func) and kwargs.get("generator") is None:
            kwargs["generator"] = self.runtime.generator
        return kwargs

    def _takes_generator(self, func) -> bool:
        if func not in self._generator_args:
            self._generator_args[func] = any(a.name == "generator" and a.kwarg_only for a in func._schema.arguments)
        return self._generator_args[func]

    def _as_cuda_gives(self, func, out, cuda_outputs, inputs):
        """The host's outputs placed on the device, in CUDA's layout where the kernel's differs (code that views
        such an output as contiguous fails as on a GPU); a shape or dtype CUDA's kernel would not give is this
        package's gap, named."""
        single = not isinstance(out, (list, tuple))
        flat = [out] if single else list(leaves(out))
        if len(flat) != len(cuda_outputs):
            raise FakeCudaError(f"{func}: {len(flat)} outputs on the host, {len(cuda_outputs)} on CUDA")
        storages = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
        laid_out = {}
        for i, (real, cuda) in enumerate(zip(flat, cuda_outputs)):
            if not isinstance(real, torch.Tensor) or cuda is None or cuda.device.type != "cuda":
                continue
            if real.shape != cuda.shape or real.dtype != cuda.dtype:
                raise FakeCudaError(
                    f"{func}: CUDA's kernel returns {str(cuda.dtype).removeprefix('torch.')}{list(cuda.shape)} where "
                    f"the host's returns {describe(real)}; tools/fake_cuda/kernels.py needs a stand-in for it"
                )
            if real.numel() > 1 and real.stride() != cuda.stride and real.untyped_storage().data_ptr() not in storages:
                copy = torch.empty_strided(cuda.shape, cuda.stride, dtype=real.dtype)
                copy.copy_(real)
                laid_out[i] = real = copy
            self.memory.place(real, cuda.device)
        if not laid_out:
            return out
        if single:
            return laid_out[0]
        flat, spec = tree_flatten(out)
        return tree_unflatten([laid_out.get(i, x) for i, x in enumerate(flat)], spec)


class _Kernels(TorchDispatchMode):
    """Every operation below autograd (the backward's too: it runs on this thread, the data being on the
    host), through the session."""

    def __init__(self, session: FakeCuda):
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunction():
            return self.session.run(func, args, kwargs or {})
