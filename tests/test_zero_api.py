"""zerotron.zero's user-facing calls: zero.Init builds partitioned parameters and GatheredParameters
round-trips them (also persistent ones, into the fp32 masters), and the misuses refused with a clear
error (zero.Init without stage 3, a non-elementwise optimizer, a second boundary backward in stage 1)."""

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
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
from zerotron.zero.residency import holder_of

STEPS = 4


# ---- zero.Init and GatheredParameters ---------------------------------------------------------
def _init_and_gather():
    dp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234)
    with zerotron.zero.Init():
        model = make_model()
    built_on_meta = all(p.numel() == 0 and p.ds_tensor.numel() > 0 for p in model.parameters())  # pieces only
    engine, *_ = zerotron.initialize(
        model=model, config=ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    )
    held = engine.memory_report()["params"]
    initial = zerotron.zero.consolidated_state_dict(engine.module)
    losses = [engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item() for b in global_batches(STEPS, 2 * dp)]
    final = zerotron.zero.consolidated_state_dict(engine.module)
    # rank 0 zeroes a weight; every rank must see it, in its shard and in its fp32 master
    w = engine.module.layers[0].attn.wq.weight
    # (None: an absent bias, as Transformers hands in [lm_head.weight, lm_head.bias] to resize a head)
    with zerotron.zero.GatheredParameters([w, None], modifier_rank=0):
        if rank == 0:
            w.data.zero_()
    with zerotron.zero.GatheredParameters([w]):
        zeroed = bool((w == 0).all())
    bucket = holder_of(w).bucket
    index = next(i for i, p in enumerate(bucket.params) if p is w)
    master_pieces = [bucket.master[s : s + n] for i, _, s, n in bucket.param_slices_in_shard() if i == index]
    masters_zero = all(bool((m == 0).all()) for m in master_pieces)
    return built_on_meta, held, initial, losses, final, zeroed and masters_zero, w.untyped_storage().size()


def test_init_builds_partitioned_and_gathered_parameters_round_trip():
    results = run_ranks(_init_and_gather, 2)
    full_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    for built_on_meta, held, initial, losses, final, zeroed, storage_after in results:
        assert built_on_meta
        assert held <= full_bytes / 2 * 1.01  # each rank holds its half (plus padding)
        assert zeroed and storage_after == 0  # visible when gathered and in the masters; freed after
    # both ranks materialized the same initial model, and trained it identically
    assert max_weight_diff(results[0][2], results[1][2]) == 0.0
    assert max_weight_diff(results[0][4], results[1][4]) == 0.0
    # the initial values match the model's own init scheme (std 0.02, scaled residual projections)
    emb = results[0][2]["tok_emb.weight"]
    assert abs(emb.std().item() - 0.02) < 2e-3
    ref = make_model()
    ref.load_state_dict(results[0][2])
    ref_losses, _ = reference_training(global_batches(STEPS, 4), model=ref)
    assert_losses_close(results[0][3], ref_losses, rtol=1e-5)


def _meta_without_stage3():
    with zerotron.zero.Init():
        model = make_model()
    zerotron.initialize(model=model, config=ds_config(2, 1, zero_optimization={"stage": 2}))


def test_init_without_stage3_is_a_clear_error():
    with pytest.raises(RankError, match="needs zero_optimization.stage 3"):
        run_ranks(_meta_without_stage3, 1)


def _lbfgs_with_stage(stage):
    model = make_model()
    zerotron.initialize(
        model=model,
        optimizer=torch.optim.LBFGS(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}},
    )


def test_non_elementwise_optimizer_is_refused():
    with pytest.raises(RankError, match="elementwise"):
        run_ranks(_lbfgs_with_stage, 2, 2)


def _modify_persistent():
    engine, *_ = zerotron.initialize(
        model=make_model(),
        config=ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 100}),
    )
    w = engine.module.norm.weight  # 64 elements: kept whole on every rank
    with zerotron.zero.GatheredParameters([w], modifier_rank=0):
        if dist.get_rank() == 0:
            w.data.fill_(7.0)
    seen = w.detach().clone()
    b = holder_of(w).bucket
    master_full = torch.zeros(b.padded_numel)
    start, end = b.shard_range
    master_full[start:end] = b.master
    dist.all_reduce(master_full)
    off = b.offsets[[id(p) for p in b.params].index(id(w))]
    return seen, master_full[off : off + 64]


def test_gathered_parameters_modifier_reaches_persistent_parameters():
    for seen, master in run_ranks(_modify_persistent, 2):
        assert bool((seen == 7).all()) and bool((master == 7).all())
