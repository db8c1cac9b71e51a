"""What an offloaded step would cost a GPU: the host's passes over the shard, no copies from pageable
memory to the device, page-locked host memory registered for exactly as long as it exists, and
parameter shards uploaded on the transfer stream with their gather."""

import pytest
import torch
from distributed import run_ranks
from parity import ds_config, global_batches, make_model, micro_batches

import zerotron


# ---- the host's passes and the transfers of an offloaded step (what a GPU would pay for) -----------------
def _host_passes(client_optimizer: bool, stage: int = 2):
    """bf16 with optimizer offload, 4 steps: the full fp32 -> bf16 passes over the host shard each step
    makes, and whether the staging buffer holds the weights after each step."""
    from zerotron.zero.offload import HostBuffers

    casts = []
    real = HostBuffers._cast_masters
    HostBuffers._cast_masters = lambda self: (casts.append(1), real(self))[1]
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    config = ds_config(2, 1, zero_optimization=zero, bf16={"enabled": True})
    optimizer = None
    if client_optimizer:
        config.pop("optimizer")
        optimizer = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=config, optimizer=optimizer)
    per_step, flags = [], []
    for b in global_batches(4, 4):
        before = len(casts)
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, 1)))
        per_step.append(len(casts) - before)
        flags.append(engine.states.host.staging_has_weights)
    return per_step, flags, type(engine.optimizer).__name__


@pytest.mark.parametrize("client,casts", [(False, 0), (True, 1)])
def test_an_offloaded_step_casts_the_masters_only_when_the_optimizer_does_not(client, casts):
    """CPU Adam writes the bf16 weights into the staging buffer as it updates each chunk: the step
    makes no other pass (it made a second, full one every step). Another optimizer: one cast per step."""
    for per_step, flags, name in run_ranks(_host_passes, 2, client):
        assert name == ("AdamW" if client else "CPUAdam")
        assert per_step == [casts] * 4 and flags == [True] * 4


def _uploads_in_an_offloaded_fp16_step():
    from tools.fake_cuda import FakeCuda

    gpu = FakeCuda.current()
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    config = ds_config(2, 1, zero_optimization=zero, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=config)
    batches = [
        [(x.cuda(), y.cuda()) for x, y in micro_batches(b, engine.coords.dp, 2, 1)] for b in global_batches(3, 4)
    ]
    engine.train_batch(iter(batches[0]))
    gpu.take_syncs()
    for b in batches[1:]:
        engine.train_batch(iter(b))
    uploads = [str(s) for s in gpu.syncs + gpu.staged if "to the device" in s.what]
    return uploads, engine.skipped_steps


def test_an_offloaded_fp16_step_copies_nothing_from_pageable_memory_to_the_device():
    """On a fake GPU (tools/fake_cuda): the unscale factor multiplies the device-measured norms as a Python
    number, not as a host tensor copied to the device each step (a copy from pageable memory that may wait for
    the GPU); nothing else goes up either."""
    for uploads, skipped in run_ranks(_uploads_in_an_offloaded_fp16_step, 2, fake_cuda=True):
        assert skipped == 0
        assert not uploads, uploads
        # (the host step reads the device-measured norms: after it waited for the gradients anyway)


# ---- page-locked host memory: registered for exactly as long as it exists ---------------------------------
class _RecordingRuntime:
    """A stand-in for the CUDA runtime's cudaHostRegister / cudaHostUnregister."""

    def __init__(self):
        self.live, self.registered, self.unregistered = set(), 0, 0

    def cudaHostRegister(self, address, nbytes, flags):
        assert address not in self.live, "an address registered twice"
        self.live.add(address)
        self.registered += 1
        return 0

    def cudaHostUnregister(self, address):
        assert address in self.live, "an address unregistered that was not registered"
        self.live.remove(address)
        self.unregistered += 1
        return 0


def _pinned_over_build_and_destroy(cycles=3):
    import gc

    import torch.distributed as dist

    from zerotron.zero import offload

    runtime = _RecordingRuntime()
    offload._cudart, offload.can_pin = (lambda: runtime), (lambda: True)
    seen = []
    for i in range(cycles):
        # DeepSpeed's default pin_memory (false) is pinned too: pageable memory stalls backward on a GPU
        zero = {
            "stage": 3 if i % 2 else 2,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
        }
        if i % 2:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        engine = zerotron.initialize(model=make_model(n_kv_head=4), config=ds_config(2, 1, zero_optimization=zero))[0]
        engine.train_batch(
            iter(
                micro_batches(
                    global_batches(1, 2 * dist.get_world_size())[0], engine.coords.dp, dist.get_world_size(), 1
                )
            )
        )
        seen.append(len(runtime.live))
        engine.destroy()
        del engine
        gc.collect()
    return seen, len(runtime.live), runtime.registered, runtime.unregistered


def test_pinned_host_memory_is_unregistered_when_the_engine_goes():
    for seen, live, registered, unregistered in run_ranks(_pinned_over_build_and_destroy, 2):
        assert all(n > 0 for n in seen)  # every engine pinned its host buffers, unpinned ones too
        assert live == 0 and registered == unregistered > 0


def _uploads_of_offloaded_parameters():
    """ZeRO-3 offload_param: each gather's host-to-device copy of the shard, and whether it was issued
    on the transfer side (offload.Uploads.issue), with the gather that reads it."""
    import contextlib

    import torch.distributed as dist

    from zerotron.zero import offload, units

    inside, calls = [False], []
    real_issue, real_to_device = offload.Uploads.issue, units.to_device

    @contextlib.contextmanager
    def issue(self):
        with real_issue(self):
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    offload.Uploads.issue = issue
    units.to_device = lambda t, device=None: (calls.append(inside[0]), real_to_device(t, device))[1]
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    }
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=ds_config(2, 1, zero_optimization=zero))
    world = dist.get_world_size()
    for b in global_batches(2, 2 * world):
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, world, 1)))
    return calls


def test_offloaded_parameters_are_uploaded_on_the_transfer_stream_with_their_gather():
    """On a GPU the shard's copy over PCIe runs on a side stream and the gather is issued from
    there, so compute does not wait for the next unit's copy (it did, on the compute stream)."""
    for calls in run_ranks(_uploads_of_offloaded_parameters, 2):
        assert calls and all(calls), calls
