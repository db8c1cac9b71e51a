"""The reference model as a mixture of experts (GPTConfig.n_experts; `zerotron train --model moe-*`):
its experts through torch's grouped matrix multiply equal a loop over the experts, its load-balancing
loss is Switch Transformer's, and expert parallelism from the config's "expert_parallel" section
(the same split Transformers' MoE families get) trains it like one process holding every expert: ep 2
under ZeRO-1 with gradient accumulation, ZeRO-3, and ep 2 x expert-data 2 under ZeRO-2."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from parity import (
    assert_losses_close,
    ds_config,
    global_batches,
    make_model,
    max_weight_diff,
    micro_batches,
    reference_training,  # fmt: skip
)

from zerotron.moe.grouped import grouped_linear

MOE = dict(n_experts=4, top_k=2, expert_ffn=96, aux_loss_coef=0.0)  # (the aux loss is per rank: see below)
STEPS, BATCH = 4, 8


def test_grouped_matmul_equals_a_loop_over_the_experts():
    torch.manual_seed(0)
    rows, weight = torch.randn(10, 16, requires_grad=True), torch.randn(3, 8, 16, requires_grad=True)
    counts = [3, 0, 7]  # an expert without rows
    got = grouped_linear(rows, weight, counts)
    (got * torch.arange(8.0)).sum().backward()
    want_rows, want_weight = rows.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    want = torch.cat([F.linear(r, w) for r, w in zip(want_rows.split(counts), want_weight)])
    (want * torch.arange(8.0)).sum().backward()
    assert (
        torch.equal(got, want) and torch.equal(rows.grad, want_rows.grad) and torch.equal(weight.grad, want_weight.grad)
    )


def test_uniform_routing_has_load_balancing_loss_one():
    model = make_model(n_experts=4, top_k=2, expert_ffn=96)
    for layer in model.layers:
        torch.nn.init.zeros_(layer.mlp.router.weight)
    x, y = global_batches(1, 2)[0]
    model(x, y)
    assert all(abs(layer.mlp.aux_loss.item() - 1.0) < 1e-6 for layer in model.layers)


def _train(stage, ep, gas, policy="none"):
    import torch.distributed as dist

    import zerotron
    from zerotron.zero import consolidated_state_dict

    dp = dist.get_world_size()
    config = ds_config(BATCH // (dp * gas), gas, zero_optimization={"stage": stage},
                       expert_parallel={"enabled": True, "autoep_size": ep},
                       zerotron={"checkpoint_policy": policy})  # fmt: skip
    engine, *_ = zerotron.initialize(model=make_model(**MOE), config=config)
    losses = [
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item()
        for b in global_batches(STEPS, BATCH)
    ]
    return losses, consolidated_state_dict(engine.module), engine.comm_stats()["all_to_all"]


@pytest.mark.parametrize(
    "world,ep,stage,gas,policy",
    [(2, 2, 1, 2, "none"), (2, 2, 3, 1, "every_block"), (4, 2, 2, 1, "none")],  # every_block: the
)  # recomputed forward exchanges its tokens again
def test_expert_parallel_reference_moe_trains_like_one_process(world, ep, stage, gas, policy):
    want_losses, want = reference_training(global_batches(STEPS, BATCH), **MOE)
    for losses, state, exchanged in run_ranks(_train, world, stage, ep, gas, policy, timeout=120):
        assert_losses_close(losses, want_losses, 1e-5)
        assert max_weight_diff(state, want) < 1e-5 and exchanged > 0


def _overflow_on_one_rank():
    """fp16 at ep 2 (ZeRO-2, each rank the only holder of its experts): at step 1 rank 1's expert
    gradient overflows, nowhere else."""
    import torch.distributed as dist

    import zerotron

    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}  # (halves at the first overflow)
    config = ds_config(BATCH // 2, 1, zero_optimization={"stage": 2}, fp16=fp16,
                       expert_parallel={"enabled": True, "autoep_size": 2})  # fmt: skip
    engine, *_ = zerotron.initialize(model=make_model(**MOE), config=config)
    expert = engine.module.layers[0].mlp.experts.down_proj
    hook = None
    out = []
    for step, b in enumerate(global_batches(3, BATCH)):
        if step == 1 and dist.get_rank() == 1:
            hook = expert.register_hook(lambda g: g * float("inf"))
        loss = engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, 1)))
        if hook is not None:
            hook = hook.remove()
        out.append((engine.skipped_steps, engine.loss_scaler.scale, bool(torch.isfinite(loss))))
    return out


def test_an_overflow_in_one_ranks_experts_skips_the_step_everywhere():
    """The expert's gradient is reduced with nobody (the expert-data group has one rank), so only the
    global agreement can tell rank 0: both skip step 1 and halve the loss scale alike."""
    first, second = run_ranks(_overflow_on_one_rank, 2, timeout=60)
    assert first == second, (first, second)
    assert [skipped for skipped, _, _ in first] == [0, 1, 1] and first[2][1] == first[0][1] / 2


def test_its_pipeline_form_is_refused_while_it_has_a_load_balancing_loss():
    import zerotron
    from zerotron.models.gpt import GPT, config_for
    from zerotron.parallelize import to_pipeline

    with pytest.raises(zerotron.ConfigError, match="load-balancing loss"):
        to_pipeline(GPT(config_for("moe-tiny")), 2)
    to_pipeline(GPT(config_for("moe-tiny", aux_loss_coef=0.0)), 1)  # without it, the same loss: allowed
