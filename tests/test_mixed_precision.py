"""fp16 with dynamic loss scaling across ranks: an overflow anywhere skips the step everywhere. The model's
cast to the training dtype: parameters and persistent buffers, not the constants a model computes for itself."""

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from hf_families import tiny_config
from parity import assert_losses_close, ds_config, global_batches, make_model, micro_batches, reference_training

import zerotron


def _fp16_with_overflows(steps, overflow_steps, overflow_rank, fp16):
    dp, rank = dist.get_world_size(), dist.get_rank()
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, fp16=fp16))
    scales, losses, changed = [], [], []
    for step, batch in enumerate(global_batches(steps, 2 * dp)):
        before = [p.detach().clone() for p in engine.module.parameters()]
        x, y = micro_batches(batch, rank, dp, 1)[0]
        loss = engine(x, y)
        if step in overflow_steps and rank == overflow_rank:
            loss = loss * float("inf")  # this rank's gradients become inf/nan
        engine.backward(loss)
        engine.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / dp)
        scales.append(engine.loss_scale)
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters())))
    weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    return scales, changed, engine.skipped_steps, weights, losses


def test_overflow_on_one_rank_skips_the_step_on_all_ranks():
    fp16 = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 8,
        "loss_scale_window": 2,
        "hysteresis": 1,
        "min_loss_scale": 1,
    }
    results = run_ranks(_fp16_with_overflows, 2, 6, {1, 2}, 1, fp16)
    for scales, changed, skipped, _, _ in results:
        # overflow at steps 1 and 2 halves the scale twice; two clean steps after the last
        # overflow (window 2) pass before it doubles again, at step 5.
        assert scales == [256, 128, 64, 64, 64, 128]
        assert changed == [True, False, False, True, True, True]
        assert skipped == 2
    assert torch.equal(results[0][3], results[1][3])  # replicas stay identical


def test_hysteresis_delays_the_first_decrease():
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": 2}
    scales, changed, skipped, _, _ = run_ranks(_fp16_with_overflows, 2, 4, {0, 1, 2}, 0, fp16)[1]
    assert scales == [256, 128, 64, 64]
    assert changed == [False, False, False, True] and skipped == 3


def test_overflow_at_minimum_scale_is_a_clear_error():
    fp16 = {"enabled": True, "initial_scale_power": 0, "hysteresis": 1, "min_loss_scale": 1}
    with pytest.raises(RankError, match="minimum loss scale"):
        run_ranks(_fp16_with_overflows, 2, 2, {0}, 0, fp16)


def test_fp16_static_scale_trains_close_to_fp32():
    fp16 = {"enabled": True, "loss_scale": 1024}
    ref_losses, _ = reference_training(global_batches(4, 4))
    scales, changed, skipped, _, losses = run_ranks(_fp16_with_overflows, 2, 4, set(), 0, fp16)[0]
    assert scales == [1024] * 4 and all(changed) and skipped == 0
    # fp16 keeps 11 mantissa bits (rounding 2**-11); loss values agree to ~1e-3 relative.
    assert_losses_close(losses, ref_losses, rtol=5e-3)


def _bf16_placement():
    model_cls, hf_config = tiny_config("LlamaForCausalLM")
    torch.manual_seed(0)
    llama = model_cls(hf_config)
    tokens = torch.randint(0, hf_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    # the references: DeepSpeed 0.19.8 casts parameters only; module.to(bf16) casts inv_freq too
    as_deepspeed = model_cls(hf_config)
    as_deepspeed.load_state_dict(llama.state_dict())
    for p in as_deepspeed.parameters():
        p.data = p.data.to(torch.bfloat16)
    fully_cast = model_cls(hf_config).to(torch.bfloat16)
    fully_cast.load_state_dict(llama.state_dict())
    refs = [m(input_ids=tokens, labels=tokens).loss.item() for m in (as_deepspeed, fully_cast)]
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    engine, *_ = zerotron.initialize(model=llama, config=ds_config(2, 1, **bf16))
    loss = engine(input_ids=tokens, labels=tokens).loss.item()

    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    bn.register_buffer("scale", torch.tensor([0.1]), persistent=False)
    bn_engine, *_ = zerotron.initialize(model=bn, config=ds_config(4, 1, bf16={"enabled": True}))
    before = bn[1].running_mean.clone()
    bn_engine.backward(bn_engine(torch.randn(4, 4, dtype=torch.bfloat16)).float().pow(2).mean())
    bn_engine.step()
    dtypes = [llama.model.rotary_emb.inv_freq.dtype, bn[1].running_mean.dtype, bn.scale.dtype, bn[0].weight.dtype]
    return loss, refs, dtypes, not torch.equal(before, bn[1].running_mean)


def test_bf16_keeps_a_models_own_constants_and_casts_its_parameters_and_running_statistics():
    """A Llama's rotary frequencies (a non-persistent buffer) stay fp32, as in DeepSpeed 0.19.8: its first loss
    is DeepSpeed's, not that of module.to(bf16); BatchNorm's running statistics follow the parameters (torch's
    batch_norm needs them in bf16 beside bf16 weights), so a bf16 BatchNorm model trains."""
    loss, (as_deepspeed, fully_cast), dtypes, bn_stats_moved = run_ranks(_bf16_placement, 2)[0]
    assert loss == as_deepspeed and as_deepspeed != fully_cast
    assert dtypes == [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    assert bn_stats_moved
