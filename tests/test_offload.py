"""ZeRO-Offload in the engine: optimizer states and fp32 masters (and stage-3 parameter shards) in host
memory train as one process does, as the device step does bit for bit, and hold the host bytes of the
formula and the planner. On this CPU-only machine host and device memory are the same, but every
offload code path runs (copies out, host step, staging buffer, copies back). (CPU Adam and the host
step on their own: test_offload_cpu_adam.py; host passes, uploads, pinned memory:
test_offload_transfers.py.)"""

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
from zerotron.parallelize import to_pipeline

STEPS = 4


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
