"""`deepspeed.accelerator`: get_accelerator() and the device object DeepSpeed scripts call.

    from zerotron.compat.accelerator import get_accelerator
    model.to(get_accelerator().current_device_name())

Two accelerators share one base: CUDA (torch.cuda underneath) and CPU, on which streams and events
are host-side objects with CUDA's methods, so code written for a GPU runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import torch


class OpBuilderUnavailable(NotImplementedError):
    pass


def _tensor_type(name: str, dtype: torch.dtype):
    return property(lambda self: self._tensor_type(name, dtype))


def _returns(value):
    """A method that ignores its arguments and returns `value` (the no-ops of host devices)."""
    return lambda self, *args, **kwargs: value


class _Accelerator:
    _name = ""
    _communication_backend_name = ""
    synchronized = True  # operations complete before they return (no asynchronous device queue)

    def __init__(self):
        self._compile_backend = "inductor"

    @property
    def name(self) -> str:
        return self._name

    def is_synchronized_device(self):
        return self.synchronized

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def communication_backend_name(self):
        return self._communication_backend_name

    def random(self):
        return torch.random

    def supported_dtypes(self):
        return (
            [torch.float]
            + [torch.half] * bool(self.is_fp16_supported())
            + [torch.bfloat16] * bool(self.is_bf16_supported())
        )

    def is_pinned(self, tensor):
        return tensor.is_pinned()

    is_triton_supported = _returns(False)

    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]  # DeepSpeed's CPU accelerator names the same variable

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"compile backend {backend!r} is not available on {self._name}; choose one of {supported}")
        self._compile_backend = backend

    def _no_ops(self, *_args, **_kwargs):
        raise OpBuilderUnavailable(
            "zerotron compiles no ops (no op builders); use "
            "zerotron.ops.adam.FusedAdam / DeepSpeedCPUAdam instead of building one"
        )

    op_builder_dir = create_op_builder = get_op_builder = build_extension = _no_ops

    FloatTensor = _tensor_type("FloatTensor", torch.float)
    HalfTensor = _tensor_type("HalfTensor", torch.half)
    BFloat16Tensor = _tensor_type("BFloat16Tensor", torch.bfloat16)
    DoubleTensor = _tensor_type("DoubleTensor", torch.double)
    LongTensor = _tensor_type("LongTensor", torch.long)
    IntTensor = _tensor_type("IntTensor", torch.int)
    ByteTensor = _tensor_type("ByteTensor", torch.uint8)


class CUDA_Accelerator(_Accelerator):
    _name = "cuda"
    _communication_backend_name = "nccl"
    synchronized = False

    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device("cuda", device_index)

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}"

    def is_bf16_supported(self):
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self):
        # DeepSpeed's rule: compute capability 7+ (6.x only when DS_ALLOW_DEPRECATED_FP16=1).
        if not torch.cuda.is_available():
            return True
        major = torch.cuda.get_device_capability()[0]
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def available_memory(self, device_index=None):
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    def total_memory(self, device_index=None):
        return torch.cuda.get_device_properties(
            device_index if device_index is not None else torch.cuda.current_device()
        ).total_memory

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state(*([] if device_index is None else [device_index]))

    def set_rng_state(self, new_state, device_index=None):
        return torch.cuda.set_rng_state(new_state, *([] if device_index is None else [device_index]))

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index]

    def range_push(self, msg, domain=None, category=None):
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        return torch.cuda.nvtx.range_pop()

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor.pin_memory()

    def on_accelerator(self, tensor):
        return tensor.device.type == "cuda"

    def communication_backend_version(self):
        return torch.cuda.nccl.version()

    def export_envs(self):
        return ["NCCL"]

    def replay_graph(self, graph):
        graph.replay()

    def _tensor_type(self, name, dtype):
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")


# Everything else on CUDA is torch.cuda's function (or class) of the same name, or of the name given.
for _name in (
    "set_device current_device device_count synchronize is_available empty_cache memory_allocated "
    "max_memory_allocated reset_max_memory_allocated memory_reserved max_memory_reserved memory_cached "
    "max_memory_cached reset_max_memory_cached reset_peak_memory_stats memory_stats manual_seed "
    "manual_seed_all initial_seed stream current_stream default_stream Stream Event "
    "lazy_call:_lazy_call create_graph:CUDAGraph capture_to_graph:graph"
).split():
    _ours, _, _torchs = _name.partition(":")
    setattr(CUDA_Accelerator, _ours, staticmethod(getattr(torch.cuda, _torchs or _ours)))


class HostEvent:
    """torch.cuda.Event's methods on the host. Work on the CPU is done when it returns, so record()
    marks the time and every wait or query is already satisfied; elapsed_time() is host time."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    wait = synchronize = _returns(None)
    query = _returns(True)

    def elapsed_time(self, end_event) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs both events recorded first (event.record())")
        return (end_event._time - self._time) * 1000.0  # milliseconds, like CUDA's


class HostStream:
    """torch.cuda.Stream's methods on the host, where there is one in-order queue: nothing to wait for."""

    def __init__(self, device=None, priority=0, **_kwargs):
        self.device = torch.device("cpu")

    synchronize = wait_stream = wait_event = _returns(None)
    query = _returns(True)

    def record_event(self, event=None):
        event = event or HostEvent()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_HOST_STREAM = HostStream()


class CPU_Accelerator(_Accelerator):
    _name = "cpu"
    # DeepSpeed's CPU accelerator says "ccl" when oneCCL's bindings are installed, else "gloo";
    # zerotron's CPU process groups are always gloo, so gloo is what it reports.
    _communication_backend_name = "gloo"
    Stream = HostStream
    Event = HostEvent

    def __init__(self):
        super().__init__()
        self._peak = self._rss()

    device_name = current_device_name = _returns("cpu")
    is_available = is_bf16_supported = _returns(True)
    set_device = synchronize = empty_cache = range_push = range_pop = replay_graph = _returns(None)
    create_graph = _returns(None)

    def device(self, device_index=None):
        return torch.device("cpu")  # DeepSpeed returns None; a device is what callers pass to .to()

    def current_device(self):
        return int(os.environ.get("LOCAL_RANK", 0))  # DeepSpeed's value (it returns the variable's text)

    def device_count(self):
        # DeepSpeed: LOCAL_SIZE, else the host's NUMA node count; zerotron counts the host as one device.
        return int(os.environ.get("LOCAL_SIZE", 0)) or 1

    def is_fp16_supported(self):
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # noqa: BLE001 (a build without oneDNN)
            return False

    # Memory, like DeepSpeed's CPU accelerator: the process's resident set size ("allocated",
    # "reserved" and "cached" alike), with a peak kept since the last reset; totals are the host's.
    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return 0

    def memory_allocated(self, device_index=None):
        rss = self._rss()
        self._peak = max(self._peak, rss)
        return rss

    def max_memory_allocated(self, device_index=None):
        self.memory_allocated()
        return self._peak

    def reset_peak_memory_stats(self, device_index=None):
        self._peak = self._rss()

    memory_reserved = memory_cached = memory_allocated
    max_memory_reserved = max_memory_cached = max_memory_allocated
    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index=None):
        return {"allocated_bytes.all.current": self.memory_allocated(), "allocated_bytes.all.peak": self._peak}

    def total_memory(self, device_index=None):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def available_memory(self, device_index=None):
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    manual_seed = manual_seed_all = staticmethod(torch.manual_seed)
    initial_seed = staticmethod(torch.initial_seed)
    default_generator = _returns(torch.default_generator)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index=None):
        return torch.set_rng_state(new_state)

    def stream(self, stream):
        return contextlib.nullcontext(stream)

    current_stream = default_stream = _returns(_HOST_STREAM)

    def lazy_call(self, callback):
        return callback()

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor  # as DeepSpeed's CPU accelerator: nothing to page-lock for (and torch can't without a GPU)

    def on_accelerator(self, tensor):
        return tensor.device.type == "cpu"

    def export_envs(self):
        return []

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def _tensor_type(self, name, dtype):
        return getattr(torch, name)  # the legacy CPU constructors, as DeepSpeed's CPU accelerator returns


_accelerator = None


def get_accelerator():
    """The process's accelerator: DS_ACCELERATOR (cpu or cuda) when set, else CUDA when torch sees a GPU."""
    global _accelerator
    if _accelerator is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in ("cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={name!r}: zerotron runs on 'cpu' or 'cuda'; set one of them or unset it")
        _accelerator = CUDA_Accelerator() if name == "cuda" else CPU_Accelerator()
    return _accelerator


def set_accelerator(accelerator) -> None:
    global _accelerator
    _accelerator = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in ("cuda", "cpu")
