"""`torch.cuda` as a process with GPUs sees it, on a machine without one: devices to pick, streams and events
(work runs in issue order on one host thread, so every wait is already met), the random generator, device
memory (the bytes of the storages placed on a device), page-locked host memory through the CUDA runtime's
`cudaHostRegister` (which can be told to fail, leaving CUDA's last error set as the real runtime does), and the
calls that make the host wait for the device, reported to the session."""

from __future__ import annotations

import contextlib
import time
import types

import torch

from . import patch

PROPERTIES = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (fake CUDA)",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    multi_processor_count=132,
    is_integrated=False,
    is_multi_gpu_board=False,
    L2_cache_size=50 * 2**20,
)
CUDA_ERROR_MEMORY_ALLOCATION = 2


class Stream:
    """A CUDA stream: here work runs when it is issued, in one order, so what a stream waits for is done."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device, self.priority = torch.device("cuda", _RUNTIME.index_of(device)), priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        _RUNTIME.synchronized("torch.cuda.Stream.synchronize")

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self.enable_timing, self.when = enable_timing, None

    def record(self, stream=None) -> None:
        self.when = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _RUNTIME.synchronized("torch.cuda.Event.synchronize")

    def elapsed_time(self, end: "Event") -> float:
        if not (self.enable_timing and end.enable_timing) or self.when is None or end.when is None:
            raise RuntimeError("CUDA error: invalid resource handle (both events must be recorded with enable_timing)")
        return (end.when - self.when) * 1e3


class Cudart:
    """The CUDA runtime's binding (`torch.cuda.cudart()`), with cudaGetLastError, which CUDA has and torch does
    not bind: zerotron reaches it in the loaded runtime, and a stand-in here is what a test sees."""

    def __init__(self, runtime: "Runtime"):
        self.runtime = runtime
        self.fail_host_register = False

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        if self.fail_host_register:
            self.runtime.last_error = CUDA_ERROR_MEMORY_ALLOCATION
            return CUDA_ERROR_MEMORY_ALLOCATION
        self.runtime.memory.register(address, nbytes)
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        return 0 if self.runtime.memory.unregister(address) else 1

    def cudaGetLastError(self) -> int:
        error, self.runtime.last_error = self.runtime.last_error, 0
        return error

    def cudaGetErrorString(self, error: int) -> str:
        return {0: "no error", CUDA_ERROR_MEMORY_ALLOCATION: "out of memory"}.get(int(error), f"error {int(error)}")

    def cudaProfilerStart(self) -> int:
        return 0

    def cudaProfilerStop(self) -> int:
        return 0


_RUNTIME: "Runtime | None" = None  # the one the Stream and Event stand-ins ask


class Runtime:
    def __init__(self, session, device_count: int, index: int):
        self.session, self.memory = session, session.memory
        self.device_count, self.index = device_count, index
        self.generator = torch.Generator().manual_seed(0)
        self.stream = Stream.__new__(Stream)  # (before this runtime is installed)
        self.stream.device, self.stream.priority = torch.device("cuda", index), 0
        self.cudart = Cudart(self)
        self.last_error = 0
        self.sync_debug_mode = 0

    def index_of(self, device=None) -> int:
        if device is None:
            return self.index
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return self.index if d.index is None else d.index

    def synchronized(self, what: str) -> None:
        self.session.host_waits(what)

    # ---- the stand-ins, by name in torch.cuda ----
    def functions(self) -> dict:
        index_of = self.index_of

        def set_device(device) -> None:
            index = index_of(device)
            if not 0 <= index < self.device_count:
                raise RuntimeError(f"CUDA error: invalid device ordinal ({index} of {self.device_count})")
            self.index = index

        @contextlib.contextmanager
        def stream(s):
            previous = self.stream
            self.stream = s or previous
            try:
                yield
            finally:
                self.stream = previous

        class device:  # noqa: N801 (torch.cuda.device)
            def __init__(inner, device):
                inner.index, inner.previous = index_of(device) if device is not None else -1, None

            def __enter__(inner):
                inner.previous = self.index
                if inner.index >= 0:
                    set_device(inner.index)

            def __exit__(inner, *exc):
                self.index = inner.previous
                return False

        def get_rng_state(device="cuda") -> torch.Tensor:
            return self.generator.get_state()

        def set_rng_state(state, device="cuda") -> None:
            self.generator.set_state(state.cpu() if isinstance(state, torch.Tensor) else state)

        def manual_seed(seed) -> None:
            self.generator.manual_seed(int(seed))

        def set_sync_debug_mode(mode) -> None:
            self.sync_debug_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

        return {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "_lazy_init": lambda: None,
            "init": lambda: None,
            "device_count": lambda: self.device_count,
            "current_device": lambda: self.index,
            "set_device": set_device,
            "device": device,
            "synchronize": lambda device=None: self.session.host_waits("torch.cuda.synchronize", device_wide=True),
            "Stream": Stream,
            "Event": Event,
            "stream": stream,
            "current_stream": lambda device=None: self.stream,
            "default_stream": lambda device=None: self.stream,
            "set_stream": lambda s: setattr(self, "stream", s),
            "get_rng_state": get_rng_state,
            "set_rng_state": set_rng_state,
            "get_rng_state_all": lambda: [get_rng_state()],
            "set_rng_state_all": lambda states: set_rng_state(states[0]),
            "manual_seed": manual_seed,
            "manual_seed_all": manual_seed,
            "seed": lambda: None,
            "seed_all": lambda: None,
            "initial_seed": lambda: self.generator.initial_seed(),
            "memory_allocated": lambda device=None: self.memory.allocated(),
            "max_memory_allocated": lambda device=None: max(self.memory.peak, self.memory.allocated()),
            "memory_reserved": lambda device=None: self.memory.allocated(),
            "max_memory_reserved": lambda device=None: max(self.memory.peak, self.memory.allocated()),
            "reset_peak_memory_stats": lambda device=None: setattr(self.memory, "peak", self.memory.allocated()),
            "reset_max_memory_allocated": lambda device=None: setattr(self.memory, "peak", self.memory.allocated()),
            "empty_cache": lambda: None,
            "mem_get_info": lambda device=None: (
                PROPERTIES.total_memory - self.memory.allocated(),
                PROPERTIES.total_memory,
            ),
            "get_device_properties": lambda device=None: PROPERTIES,
            "get_device_name": lambda device=None: PROPERTIES.name,
            "get_device_capability": lambda device=None: (PROPERTIES.major, PROPERTIES.minor),
            "is_bf16_supported": lambda including_emulation=True: True,
            "cudart": lambda: self.cudart,
            "is_current_stream_capturing": lambda: False,
            "set_sync_debug_mode": set_sync_debug_mode,
            "get_sync_debug_mode": lambda: self.sync_debug_mode,
        }

    @contextlib.contextmanager
    def installed(self):
        """torch.cuda's functions replaced by this runtime's for as long as the block runs."""
        global _RUNTIME
        functions = self.functions()
        patches = [(torch.cuda, name, value) for name, value in functions.items()]
        patches += [(torch.cuda.nvtx, name, lambda *a, **k: None) for name in ("range_push", "range_pop", "mark")]
        patches += [(torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())]
        patches += [(torch.accelerator, "is_available", lambda: True)]
        patches += [(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))]
        patches += [(torch.accelerator, "device_count", lambda: self.device_count)]
        patches += [(torch.accelerator, "current_device_index", lambda: self.index)]
        patches += [(torch.accelerator, "current_stream", lambda device=None: self.stream)]
        patches += [(torch.accelerator, "synchronize", functions["synchronize"])]
        previous, _RUNTIME = _RUNTIME, self
        try:
            with patch.installed(patches):
                yield self
        finally:
            _RUNTIME = previous
