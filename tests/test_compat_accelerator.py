"""DeepSpeed's `get_accelerator()` as scripts call it: the CPU accelerator (devices, dtypes, seeds, streams
and events, memory numbers, compile backend, op builders) and the CUDA one's names without a GPU."""

import time

import pytest
import torch
from distributed import run_ranks

from zerotron.compat import accelerator as accel_module
from zerotron.compat.accelerator import CPU_Accelerator, CUDA_Accelerator, get_accelerator


@pytest.fixture
def fresh_accelerator(monkeypatch):
    """get_accelerator() decides again (the singleton is restored afterwards)."""
    monkeypatch.setattr(accel_module, "_accelerator", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)


# --- the accelerator on CPU ---------------------------------------------------------------------


def test_get_accelerator_is_a_cpu_singleton_without_a_gpu(fresh_accelerator):
    acc = get_accelerator()
    assert acc is get_accelerator()
    assert isinstance(acc, CPU_Accelerator) and acc.name == acc._name == "cpu"
    assert accel_module.is_current_accelerator_supported()
    other = CPU_Accelerator()
    accel_module.set_accelerator(other)
    assert get_accelerator() is other


def test_ds_accelerator_environment_variable(fresh_accelerator, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    acc = get_accelerator()
    assert isinstance(acc, CUDA_Accelerator) and acc.is_available() == torch.cuda.is_available()
    monkeypatch.setattr(accel_module, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        get_accelerator()


def test_cpu_device_names_counts_and_backend(monkeypatch):
    acc = CPU_Accelerator()
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.device(0) == torch.device("cpu") and acc.set_device(1) is None
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert acc.current_device() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert acc.current_device() == 3  # DeepSpeed's CPU accelerator: LOCAL_RANK
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert acc.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert acc.device_count() == 4
    assert acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.is_synchronized_device() and acc.use_host_timers() and acc.resolves_data_dependency()
    assert acc.handles_memory_backpressure() and acc.synchronize() is None and acc.synchronize(0) is None
    assert acc.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env = {}
    acc.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}


def test_cpu_dtypes_match_deepspeeds_cpu_accelerator():
    acc = CPU_Accelerator()
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert acc.is_bf16_supported() is True and acc.is_fp16_supported() is fp16
    assert set(acc.supported_dtypes()) == {torch.float32, torch.bfloat16} | ({torch.float16} if fp16 else set())
    made = {
        name: getattr(acc, name)([1, 2])
        for name in (
            "FloatTensor",
            "HalfTensor",
            "BFloat16Tensor",
            "DoubleTensor",
            "LongTensor",
            "IntTensor",
            "ByteTensor",
        )
    }
    assert {n: t.dtype for n, t in made.items()} == {
        "FloatTensor": torch.float32,
        "HalfTensor": torch.float16,
        "BFloat16Tensor": torch.bfloat16,
        "DoubleTensor": torch.float64,
        "LongTensor": torch.int64,
        "IntTensor": torch.int32,
        "ByteTensor": torch.uint8,
    }
    assert all(t.tolist() == [1, 2] and t.device.type == "cpu" for t in made.values())


def test_cpu_seeds_are_reproducible():
    acc = CPU_Accelerator()
    acc.manual_seed(1234)
    a = torch.rand(4)
    assert acc.initial_seed() == 1234
    state = acc.get_rng_state()
    b = torch.rand(4)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(4), b)
    acc.manual_seed_all(1234)
    assert torch.equal(torch.rand(4), a)
    assert acc.default_generator(0) is torch.default_generator and acc.random() is torch.random
    acc.default_generator(0).manual_seed(7)
    first = torch.rand(2)
    acc.manual_seed(7)
    assert torch.equal(torch.rand(2), first) and not torch.equal(first, a[:2])


def test_cpu_streams_and_events_are_usable():
    acc = CPU_Accelerator()
    stream = acc.Stream()
    with acc.stream(stream):
        x = torch.ones(3) * 2
    stream.synchronize()
    acc.current_stream().wait_stream(stream)
    assert stream.query() and acc.default_stream() is acc.current_stream()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)
    start.record()
    time.sleep(0.02)
    end.record(acc.current_stream())
    end.synchronize()
    end.wait(stream)
    assert end.query() and 15.0 <= start.elapsed_time(end) < 5000.0  # milliseconds
    event = stream.record_event()
    stream.wait_event(event)
    assert isinstance(event, acc.Event) and event.query() and x.tolist() == [2.0, 2.0, 2.0]
    assert acc.range_push("step") is None and acc.range_pop() is None
    assert acc.lazy_call(lambda: 42) == 42


def test_cpu_pin_memory_and_placement():
    acc = CPU_Accelerator()
    t = torch.arange(6.0).view(2, 3)
    pinned = acc.pin_memory(t)
    assert isinstance(pinned, torch.Tensor) and torch.equal(pinned, t)
    assert acc.pin_memory(t, make_copy=False, match_shape=False) is t and acc.is_pinned(t) is False
    assert acc.on_accelerator(t) and not acc.on_accelerator(torch.empty(1, device="meta"))


def test_cpu_memory_numbers_are_the_process_and_host():
    acc = CPU_Accelerator()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written so it is resident
    during = acc.memory_allocated()
    assert before > 0 and during - before > 32 * 2**20
    del block
    assert acc.max_memory_allocated() >= during and acc.max_memory_reserved() >= during
    assert acc.memory_reserved() > 0 and acc.memory_cached() > 0 and acc.max_memory_cached() >= during
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= during and stats["allocated_bytes.all.current"] > 0
    acc.reset_max_memory_allocated()  # the peak restarts from now, not from the 64 MiB above
    assert acc.max_memory_allocated() - acc.memory_allocated() < 16 * 2**20
    assert acc.total_memory() > acc.available_memory() > 0
    assert acc.empty_cache() is None


def _compile_backend():
    acc = CPU_Accelerator()
    before = acc.get_compile_backend()
    acc.set_compile_backend("eager")
    try:
        acc.set_compile_backend("no-such-backend")
    except ValueError as e:
        return before, acc.get_compile_backend(), str(e)


def test_compile_backend():
    # in a rank process, whose fork server has already imported torch._dynamo (seconds, here)
    ((before, after, error),) = run_ranks(_compile_backend, 1)
    assert (before, after) == ("inductor", "eager") and "no-such-backend" in error and "inductor" in error


def test_op_builders_say_what_to_use_instead():
    acc = CPU_Accelerator()
    for call in (
        lambda: acc.create_op_builder("CPUAdamBuilder"),
        lambda: acc.get_op_builder("FusedAdamBuilder"),
        acc.op_builder_dir,
    ):
        with pytest.raises(NotImplementedError, match="zerotron compiles no ops.*FusedAdam"):
            call()


def test_cuda_accelerator_names_without_touching_a_gpu():
    acc = CUDA_Accelerator()
    assert (acc.name, acc.device_name(), acc.device_name(1)) == ("cuda", "cuda", "cuda:1")
    assert acc.device(1) == torch.device("cuda", 1) and acc.communication_backend_name() == "nccl"
    assert not acc.is_synchronized_device() and not acc.use_host_timers()
    assert acc.Stream is torch.cuda.Stream and acc.Event is torch.cuda.Event
    assert not acc.on_accelerator(torch.ones(1)) and acc.device_count() == torch.cuda.device_count()
    assert acc.supported_dtypes()[0] == torch.float32
