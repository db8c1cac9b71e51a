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


def _train(stage, ep, gas):
    import torch.distributed as dist

    import zerotron
    from zerotron.zero import consolidated_state_dict

    dp = dist.get_world_size()
    config = ds_config(BATCH // (dp * gas), gas, zero_optimization={"stage": stage},
                       expert_parallel={"enabled": True, "autoep_size": ep})  # fmt: skip
    engine, *_ = zerotron.initialize(model=make_model(**MOE), config=config)
    losses = [
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item()
        for b in global_batches(STEPS, BATCH)
    ]
    return losses, consolidated_state_dict(engine.module), engine.comm_stats()["all_to_all"]


@pytest.mark.parametrize("world,ep,stage,gas", [(2, 2, 1, 2), (2, 2, 3, 1), (4, 2, 2, 1)])
def test_expert_parallel_reference_moe_trains_like_one_process(world, ep, stage, gas):
    want_losses, want = reference_training(global_batches(STEPS, BATCH), **MOE)
    for losses, state, exchanged in run_ranks(_train, world, stage, ep, gas, timeout=120):
        assert_losses_close(losses, want_losses, 1e-5)
        assert max_weight_diff(state, want) < 1e-5 and exchanged > 0
