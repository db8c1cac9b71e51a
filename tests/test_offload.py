"""ZeRO-Offload: optimizer states and fp32 masters (and stage-3 parameter shards) in host memory,
and the CPU Adam that steps them. On this CPU-only machine host and device memory are the same,
but every offload code path runs (copies out, host step, staging buffer, copies back)."""

import pytest
import torch
from distributed import run_ranks
from parity import (
    assert_losses_close,
    ds_config,
    global_batches,
    make_model,
    max_weight_diff,
    micro_batches,
    reference_training,
)

import zerotron
from zerotron.ops.adam import CPUAdam, DeepSpeedCPUAdam
from zerotron.parallelize import to_pipeline

STEPS = 4


# ---- CPU Adam ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("adamw,amsgrad", [(True, False), (False, False), (True, True)])
def test_cpu_adam_is_bit_identical_to_torch_fused(adamw, amsgrad):
    torch.manual_seed(0)
    n = 300_007  # not a multiple of the chunk size
    a, b = torch.nn.Parameter(torch.randn(n)), None
    b = torch.nn.Parameter(a.detach().clone())
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.1, adamw_mode=adamw, amsgrad=amsgrad, chunk_numel=1 << 15, threads=2)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    theirs = cls([b], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    copy = torch.empty(n, dtype=torch.bfloat16)
    ours.copy_out[a] = copy
    for _ in range(3):
        g = torch.randn(n)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a, b)
    assert torch.equal(copy, a.detach().bfloat16())  # the fused copy-out is the updated weight


def test_cpu_adam_refuses_what_it_cannot_update():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="fp32 tensors on the CPU"):
        CPUAdam([p]).step()
    with pytest.raises(ValueError, match="bias_correction=False"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.randn(2))], bias_correction=False)


# ---- the engine with offload ----------------------------------------------------------------------------
def _train(stage, optimizer, param, bf16=False, gas=1, tp=1):
    import torch.distributed as dist

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = ds_config(2, gas, zero_optimization=zero, bf16={"enabled": bf16}, tensor_parallel={"autotp_size": tp})
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=config)
    dp = dist.get_world_size() // tp
    losses = [
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item()
        for b in global_batches(STEPS, 2 * gas * dp)
    ]
    return (
        losses,
        zerotron.zero.consolidated_state_dict(engine.module),
        type(engine.optimizer).__name__,
        engine.memory_report(),
    )


@pytest.mark.parametrize(
    "stage,param,gas,world,tp",
    [(1, False, 1, 2, 1), (2, False, 2, 2, 1), (3, False, 1, 2, 1), (3, True, 2, 2, 1), (1, False, 1, 4, 2)],
)
def test_parity_with_optimizer_offload(stage, param, gas, world, tp):
    ref_losses, ref_state = reference_training(global_batches(STEPS, 2 * gas * world // tp), n_kv_head=4)
    for losses, state, optimizer, _ in run_ranks(_train, world, stage, True, param, False, gas, tp):
        assert optimizer == "CPUAdam"  # Adam/AdamW in the config become the CPU Adam, as in DeepSpeed
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def test_parameter_offload_alone():
    ref_losses, ref_state = reference_training(global_batches(STEPS, 4), n_kv_head=4)
    for losses, state, optimizer, report in run_ranks(_train, 2, 3, False, True):
        assert optimizer == "AdamW"
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert report["host"] == report["params"]  # every parameter shard waits in host memory


def test_bf16_with_offload_matches_bf16_without_bit_for_bit():
    plain = run_ranks(_train, 2, 2, False, False, True)
    offloaded = run_ranks(_train, 2, 2, True, False, True)
    for (l1, s1, *_), (l2, s2, *_) in zip(plain, offloaded):
        assert l1 == l2
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


def _shard_and_step_counters() -> tuple[int, int]:
    """Elements of a rank's shard (each gradient bucket's padded half, 2 ranks) and the bytes of the
    optimizer's step counters (one fp32 scalar per master tensor: one per bucket here)."""
    from zerotron.zero import _bucketed
    from zerotron.zero.flat import bucket_numel

    params = list(make_model(n_kv_head=4).parameters())
    buckets = _bucketed(params, bucket_numel(None, sum(p.numel() for p in params)))
    return sum(-(-sum(p.numel() for p in b) // 2) for b in buckets), 4 * len(buckets)


def test_memory_report_shows_the_optimizer_states_in_host_memory():
    (_, _, _, report), _ = run_ranks(_train, 2, 2, True, False)
    shard, steps = _shard_and_step_counters()
    # host: fp32 masters + their fp32 gradients + the fp32 staging buffer + Adam's two moments
    assert report["host"] == 4 * shard * 3 + 8 * shard + steps
    assert report["optimizer"] == 8 * shard + steps


def _pipeline_offload():
    module = to_pipeline(make_model(n_layer=4, n_kv_head=4), 2, partition_method="type:_PipeBlock")
    zero = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    engine, *_ = zerotron.initialize(model=module, config=ds_config(1, 4, zero_optimization=zero))
    return [engine.train_batch(iter(micro_batches(b, 0, 1, 4))).item() for b in global_batches(STEPS, 4)]


def test_pipeline_stages_with_optimizer_offload():
    ref_losses, _ = reference_training(global_batches(STEPS, 4), n_layer=4, n_kv_head=4)
    for losses in run_ranks(_pipeline_offload, 2):
        assert_losses_close(losses, ref_losses, rtol=1e-5)


# ---- the fused host step: CPU Adam reads the gradients where they arrived -----------------------------
def _old_path_grads(g16, inv, coef):
    """What the separate passes make of a bf16 gradient: fp32 copy, unscale (with the NaN/Inf
    check), clip."""
    g = g16.float()
    torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(1), inv.reshape(1))
    torch._foreach_mul_([g], coef)
    return g


@pytest.mark.parametrize("same_buffer", [False, True])
def test_cpu_adam_reads_bf16_gradients_and_applies_multipliers_bit_for_bit(same_buffer):
    """grad_in + grad_multipliers + copy_out equal the separate passes and torch's fused AdamW,
    also when the updated weights are written over the gradients they came from (offload's
    staging buffer); chunks of several threads, a size that is not a multiple of the chunk."""
    torch.manual_seed(0)
    n = 300_007
    a = torch.nn.Parameter(torch.randn(n))
    b = torch.nn.Parameter(a.detach().clone())
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.1, chunk_numel=1 << 15, threads=2)
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, fused=True)
    g16 = torch.empty(n, dtype=torch.bfloat16)
    out = g16 if same_buffer else torch.empty(n, dtype=torch.bfloat16)
    ours.grad_in[a], ours.copy_out[a] = g16, out
    inv, coef = torch.tensor(2.0**-10), torch.tensor(0.37)
    for _ in range(3):
        g16.copy_(torch.randn(n) * 1024)
        b.grad = _old_path_grads(g16, inv, coef)
        ours.grad_multipliers = (inv, coef)
        ours.step()
        theirs.step()
        assert torch.equal(a, b)
        assert torch.equal(out, a.detach().bfloat16())
    assert a.grad is None  # the gradient was read from grad_in, never made whole in fp32


def test_fused_host_step_measures_shards_as_they_leave_and_flags_only_nan_inf():
    """Each master run's norm is taken from the device shard as it leaves for the host (those of
    an fp32 copy, unscaled, bit for bit); the flag is set by a NaN or an Inf anywhere, not by
    finite values whose squares overflow."""
    from types import SimpleNamespace

    from zerotron.zero.offload import FusedHostStep, HostBuffers

    n = 1000
    host = HostBuffers(2 * n, torch.bfloat16, pin_memory=False)
    masters = [torch.nn.Parameter(host.masters[i * n : (i + 1) * n]) for i in range(2)]
    buckets = [SimpleNamespace(index=i, offset=i * n, shard_numel=n) for i in range(2)]
    step = FusedHostStep(
        host, CPUAdam(masters, threads=1), masters, [(0, n), (n, 2 * n)], [(buckets[0], 0, n), (buckets[1], 0, n)]
    )
    torch.manual_seed(0)
    shards = [torch.randn(n).bfloat16() for _ in range(2)]

    def flag(inv=1.0):
        for b, shard in zip(buckets, shards):
            host.gradient_out(b, shard)
        return step.inspect(inv).item()

    assert flag(2.0**-3) == 0
    for norm, shard in zip(step.norms, shards):
        assert torch.equal(norm, torch._foreach_norm([shard.float() * 2.0**-3])[0])
    assert torch.equal(host.staging, torch.cat(shards))  # the gradients arrived where the weights leave from
    for value in (float("nan"), float("inf"), float("-inf")):
        shards[1][-3] = value
        assert flag() == 1, value
    shards[1][-3] = 0.0
    shards[0][:4] = 3e38  # finite in bf16; the squares overflow fp32
    assert flag() == 0 and not torch.isfinite(step.norms[0])


def _train_steps(offload, precision, extra=None, steps=5, gas=2):
    """forward/backward/step as a DeepSpeed script; fp16 starts at 2^40, so the first steps
    overflow and are skipped; small buckets; clipping at 1.0 (active on this model)."""
    import torch.distributed as dist

    dp, rank = dist.get_world_size(), dist.get_rank()
    zero = {"stage": 2, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000, **(extra or {})}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    dtype = {
        "bf16": {"bf16": {"enabled": True}},
        "fp16": {"fp16": {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2}},
    }[precision]
    engine, *_ = zerotron.initialize(
        model=make_model(n_kv_head=4), config=ds_config(2, gas, zero_optimization=zero, **dtype)
    )
    losses, norms = [], []
    for batch in global_batches(steps, 2 * gas * dp):
        for x, y in micro_batches(batch, rank, dp, gas):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(None if engine.get_global_grad_norm() is None else float(engine.get_global_grad_norm()))
    return (
        losses,
        norms,
        zerotron.zero.consolidated_state_dict(engine.module),
        engine.skipped_steps,
        type(engine.optimizer).__name__,
    )


@pytest.mark.parametrize(
    "precision,extra",
    [("fp16", None), ("fp16", {"reshard_after_backward": True}), ("bf16", {"reshard_after_backward": True})],
)
def test_fused_host_step_trains_as_the_device_step_bit_for_bit(precision, extra):
    """Offloaded (CPU Adam reading the host gradients, unscaling and clipping in cache) and
    not: the same losses, norms and weights, bit for bit, through skipped fp16 steps; after a
    skip the freed parameters are gathered from the masters, not from the gradients that sit
    in the staging buffer."""
    plain = run_ranks(_train_steps, 2, False, precision, extra)
    offloaded = run_ranks(_train_steps, 2, True, precision, extra)
    for (l1, n1, s1, skip1, _), (l2, n2, s2, skip2, name) in zip(plain, offloaded):
        assert name == "CPUAdam"
        if precision == "fp16":
            assert skip1 == skip2 > 0
        assert l1 == l2 and n1 == n2
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_bf16_offload_keeps_no_fp32_gradients_on_the_host():
    """bf16 + CPU Adam: masters (4 bytes/element), the staging buffer the gradients arrive in and
    the weights leave from (2) and Adam's moments (8): the planner's figure."""
    (_, _, _, report), _ = run_ranks(_train, 2, 2, True, False, True)
    shard, steps = _shard_and_step_counters()
    assert report["host"] == (4 + 2 + 8) * shard + steps
    from zerotron.planner.memory import rank_state_bytes

    numels = [p.numel() for p in make_model(n_kv_head=4).parameters()]
    predicted = rank_state_bytes(numels, dp=2, stage=2, dtype="bf16", offload_optimizer=True)
    assert abs(predicted["host"] - report["host"]) <= steps + 8  # the planner leaves the step counters out


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
    from tools.sync_counter import SyncCounter

    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    config = ds_config(2, 1, zero_optimization=zero, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=config)
    batches = global_batches(3, 4)
    engine.train_batch(iter(micro_batches(batches[0], engine.coords.dp, 2, 1)))
    with SyncCounter() as counter:
        for b in batches[1:]:
            engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, 1)))
    return counter.where, engine.skipped_steps


def test_an_offloaded_fp16_step_copies_nothing_from_pageable_memory_to_the_device():
    """The unscale factor multiplies the device-measured norms as a Python number, not as a host
    tensor copied to the device each step (a copy from pageable memory waits for the GPU)."""
    for where, skipped in run_ranks(_uploads_in_an_offloaded_fp16_step, 2):
        assert skipped == 0
        uploads = [w for w in where if w.split(" at ")[0] in ("to", "copy_", "cuda", "tensor", "as_tensor")]
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
