"""ZeRO-Offload: optimizer states and fp32 masters (and stage-3 parameter shards) in host memory,
and the CPU Adam that steps them. On this CPU-only machine host and device memory are the same,
but every offload code path runs (copies out, host step, staging buffer, copies back)."""
import pytest
import torch

import zerotron
from distributed import run_ranks
from parity import (assert_losses_close, ds_config, global_batches, make_model, max_weight_diff, micro_batches,
                    reference_training)
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
    losses = [engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item()
              for b in global_batches(STEPS, 2 * gas * dp)]
    return losses, zerotron.zero.consolidated_state_dict(engine.module), type(engine.optimizer).__name__, \
        engine.memory_report()


@pytest.mark.parametrize("stage,param,gas,world,tp", [(1, False, 1, 2, 1), (2, False, 2, 2, 1), (3, False, 1, 2, 1),
                                                      (3, True, 2, 2, 1), (1, False, 1, 4, 2)])
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


def test_memory_report_shows_the_optimizer_states_in_host_memory():
    (_, _, _, report), _ = run_ranks(_train, 2, 2, True, False)
    psi = sum(p.numel() for p in make_model(n_kv_head=4).parameters())
    shard = -(-psi // 2)  # one bucket here: the shard is the padded half
    # host: fp32 masters + their fp32 gradients + the fp32 staging buffer + Adam's two moments
    assert report["host"] == 4 * shard * 3 + 8 * shard + 4  # + the step counter (one fp32 scalar)
    assert report["optimizer"] == 8 * shard + 4


def _pipeline_offload():
    module = to_pipeline(make_model(n_layer=4, n_kv_head=4), 2, partition_method="type:_PipeBlock")
    zero = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    engine, *_ = zerotron.initialize(model=module, config=ds_config(1, 4, zero_optimization=zero))
    return [engine.train_batch(iter(micro_batches(b, 0, 1, 4))).item() for b in global_batches(STEPS, 4)]


def test_pipeline_stages_with_optimizer_offload():
    ref_losses, _ = reference_training(global_batches(STEPS, 4), n_layer=4, n_kv_head=4)
    for losses in run_ranks(_pipeline_offload, 2):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
