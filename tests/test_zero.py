"""ZeRO stages 1-3: same training as one process, model states at the paper's bytes, minimal traffic."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
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


def _train(stage, micro, gas, steps, precision="fp32", zero_extra=None, model_overrides=None):
    dp, rank = dist.get_world_size(), dist.get_rank()
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **(zero_extra or {})}
    extra = {"zero_optimization": zero}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    engine, *_ = zerotron.initialize(model=make_model(**(model_overrides or {})), config=ds_config(micro, gas, **extra))
    losses = [
        engine.train_batch(iter(micro_batches(b, rank, dp, gas))).item()
        for b in global_batches(steps, micro * gas * dp)
    ]
    return losses, zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world,gas", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_fp32_parity_with_single_process(stage, world, gas):
    ref_losses, ref_state = reference_training(global_batches(STEPS, 2 * gas * world))
    for losses, state in run_ranks(_train, world, stage, 2, gas, STEPS):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


# ZeRO-3's memory/communication knobs: released after every forward with prefetching capped (the
# other extreme from the defaults the test above runs), and the fp32 step in sub-groups.
@pytest.mark.parametrize(
    "precision,zero_extra",
    [("fp32", {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1}), ("bf16", {"sub_group_size": 20_000})],
)
def test_zero3_knobs_keep_single_process_parity(precision, zero_extra):
    gas = 2
    if precision == "fp32":
        ref_losses, ref_state = reference_training(global_batches(STEPS, 2 * gas * 2))
        rtol, atol = 1e-5, 1e-5
    else:  # against stage 0 in bf16, as test_bf16_matches_stage0_bf16 (same tolerances, same reason)
        ref_losses, ref_state = run_ranks(_train, 2, 0, 2, gas, STEPS, "bf16")[0]
        rtol, atol = 1e-2, 1e-2
    for losses, state in run_ranks(_train, 2, 3, 2, gas, STEPS, precision, zero_extra):
        assert_losses_close(losses, ref_losses, rtol=rtol)
        assert max_weight_diff(state, ref_state) < atol


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_bf16_matches_stage0_bf16(stage, gas):
    base_losses, base_state = run_ranks(_train, 2, 0, 2, gas, STEPS, "bf16")[0]
    losses, state = run_ranks(_train, 2, stage, 2, gas, STEPS, "bf16")[0]
    # Same bf16 forward/backward and fp32 masters; what differs is where the bf16 gradient sums
    # are rounded (all-reduce + bf16 accumulation vs reduce-scatter + shard accumulation), i.e.
    # a few bf16 roundings (2**-8 relative) of each gradient. Over 4 steps the loss moves ~1e-3
    # relative at most and a weight by at most a couple of bf16 ulps (~4e-3 near 0.5).
    assert_losses_close(losses, base_losses, rtol=1e-2)
    assert max_weight_diff(state, base_state) < 1e-2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tied_embeddings(stage):
    ref_losses, ref_state = reference_training(global_batches(STEPS, 8), tie_embeddings=True)
    for losses, state in run_ranks(_train, 2, stage, 2, 2, STEPS, "fp32", None, {"tie_embeddings": True}):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


# ---- a model with every awkward feature stage 3 must survive ---------------------------------
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return x + self.scale * torch.tanh(self.lin(x))


class Awkward(nn.Module):
    """Tied head, a block called twice, a frozen layer, a frozen bias, buffers, and a parameter
    read outside its module's forward (the embedding weight used as the output projection)."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.blocks[1].lin.bias.requires_grad_(False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        h = self.blocks[0](h)  # the same block again
        h = self.blocks[2](self.frozen(h))
        logits = h @ self.embed.weight.t()  # the embedding read outside Embedding.forward
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _awkward_batches(steps, batch):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 64, (batch, 8), generator=g), torch.randint(0, 64, (batch, 8), generator=g))
        for _ in range(steps)
    ]


def _awkward_reference(steps, batch):
    model = Awkward()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6, fused=True)
    losses = []
    for x, y in _awkward_batches(steps, batch):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _awkward_train(stage, steps):
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = Awkward()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerotron.initialize(
        model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad]
    )
    losses = [engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item() for b in _awkward_batches(steps, 2 * dp)]
    partitioned = stage == 3 and engine.module.blocks[0].lin.weight.untyped_storage().size() == 0
    return losses, zerotron.zero.consolidated_state_dict(engine.module), partitioned


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_awkward_model(stage):
    ref_losses, ref_state = _awkward_reference(STEPS, 4)
    for losses, state, partitioned in run_ranks(_awkward_train, 2, stage, STEPS):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5
        assert partitioned == (stage == 3)


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
    with zerotron.zero.GatheredParameters([w], modifier_rank=0):
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


# ---- memory and traffic against the ZeRO paper ------------------------------------------------
def _state_bytes(stage):
    """memory_report() after a bf16 step and the next backward (the gradients of the formula are
    held until the step), an independent count of every tensor this rank holds, and the gradient
    bytes held between a step and the next backward."""
    import gc

    dp, rank = dist.get_world_size(), dist.get_rank()
    engine, *_ = zerotron.initialize(
        model=make_model(),
        config=ds_config(
            2, 1, bf16={"enabled": True}, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0}
        ),
    )
    first, second = global_batches(2, 2 * dp)
    engine.train_batch(iter(micro_batches(first, rank, dp, 1)))
    between_steps = engine.memory_report()["grads"]
    x, y = micro_batches(second, rank, dp, 1)[0]
    engine.backward(engine(x, y))
    report = engine.memory_report()
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and not obj.is_meta:
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    padding = [b.padded_numel - b.numel for b in engine.states.buckets]
    return report, sum(storages.values()), padding, between_steps


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_model_state_memory_matches_the_zero_formula(stage, world):
    psi = sum(p.numel() for p in make_model().parameters())
    k = 12  # fp32 master weights, Adam's m and v
    # Stage 1 holds the paper's 2 x psi gradients while it accumulates; after the boundary
    # backward has reduce-scattered them it keeps only its shard, as stage 2 does. Stage 3 in
    # bf16 keeps no bf16 parameter shard beside the fp32 master (each gather casts the master):
    # the paper's 16 x psi / N less 2.
    expected = {1: 2 * psi + (2 + k) * psi / world, 2: 2 * psi + (2 + k) * psi / world, 3: (2 + k) * psi / world}[stage]
    for report, counted, padding, between_steps in run_ranks(_state_bytes, world, stage):
        # Padding: each bucket is rounded up to a multiple of the world size (< world elements
        # per bucket), and those elements carry all 16 bytes of state in the sharded parts.
        assert abs(report["total"] - expected) <= 0.10 * expected, (report, expected)
        assert all(0 <= pad < world for pad in padding)
        assert report["optimizer"] == pytest.approx(8 * psi / world, rel=0.02)
        assert report["master_weights"] == pytest.approx(4 * psi / world, rel=0.02)
        # every floating-point tensor alive in the process: model states plus a few small
        # leftovers (the batch's activations are freed; rotary tables are computed per call)
        assert report["total"] <= counted <= 1.10 * report["total"], (report, counted)
        # the gradients are freed at the step, as DeepSpeed and FSDP2 free theirs
        assert between_steps == 0


def _traffic(stage, vocab, reuse):
    dp, rank = dist.get_world_size(), dist.get_rank()
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if reuse is not None:
        zero["stage3_max_reuse_distance"] = reuse
    engine, *_ = zerotron.initialize(model=make_model(vocab_size=vocab), config=ds_config(2, 1, zero_optimization=zero))
    batches = global_batches(3, 2 * dp, vocab=vocab)
    engine.train_batch(iter(micro_batches(batches[0], rank, dp, 1)))  # stage 3 traces its order here
    engine.reset_comm_stats()
    for b in batches[1:]:
        engine.train_batch(iter(micro_batches(b, rank, dp, 1)))
    stats = engine.comm_stats()
    return (stats["reduce_scatter"] + stats["all_gather"] + 2 * stats["all_reduce"]) / 2


# Stage 3: the ZeRO paper's 3 x psi gathers every parameter again for backward (DeepSpeed's
# stage3_max_reuse_distance 0); with DeepSpeed's default (1e9) a model this small keeps each unit
# gathered from its forward to its backward: 2 x psi.
@pytest.mark.parametrize("stage,factor,reuse", [(0, 2, None), (1, 2, None), (2, 2, None), (3, 3, 0), (3, 2, None)])
def test_bytes_per_step_match_theory(stage, factor, reuse):
    # A small vocabulary keeps the root unit (embedding, head), which stage 3 gathers once per
    # step instead of twice, below 3% of the parameters.
    vocab = 16
    psi_bytes = sum(p.numel() for p in make_model(vocab_size=vocab).parameters()) * 4
    # all-reduce counts as reduce-scatter + all-gather: 2 x the bytes it is handed
    for per_step in run_ranks(_traffic, 2, stage, vocab, reuse):
        assert per_step == pytest.approx(factor * psi_bytes, rel=0.05)


def _clipped(stage, clip):
    dp, rank = dist.get_world_size(), dist.get_rank()
    engine, *_ = zerotron.initialize(
        model=make_model(),
        config=ds_config(2, 1, clip=clip, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0}),
    )
    losses, norms = [], []
    for b in global_batches(STEPS, 2 * dp):
        losses.append(engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item())
        norms.append(engine.get_global_grad_norm())
    return losses, zerotron.zero.consolidated_state_dict(engine.module), norms


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_global_norm_clipping_across_shards(stage):
    clip = 0.05  # well below this model's gradient norm (~0.3), so every step is clipped
    ref_losses, ref_state = reference_training(global_batches(STEPS, 4), clip=clip)
    for losses, state, norms in run_ranks(_clipped, 2, stage, clip):
        assert min(norms) > 2 * clip
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def _fp16_overflow(stage):
    dp, rank = dist.get_world_size(), dist.get_rank()
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    engine, *_ = zerotron.initialize(
        model=make_model(),
        config=ds_config(2, 1, fp16=fp16, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0}),
    )
    scales = []
    for step, b in enumerate(global_batches(5, 2 * dp)):
        x, y = micro_batches(b, rank, dp, 1)[0]
        loss = engine(x, y)
        if step == 1 and rank == 1:
            loss = loss * float("inf")  # only this rank's shard sees the overflow after reduction
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scale)
    return scales, engine.skipped_steps, zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_skips_on_every_rank(stage):
    results = run_ranks(_fp16_overflow, 2, stage)
    for scales, skipped, _ in results:
        assert scales == [256, 128, 128, 128, 256] and skipped == 1
    assert max_weight_diff(results[0][2], results[1][2]) == 0.0


def _persistent(threshold):
    losses, state = _train(3, 2, 2, STEPS, "fp32", {"stage3_param_persistence_threshold": threshold})
    return losses, state


def _whole_params(threshold):
    engine, *_ = zerotron.initialize(
        model=make_model(),
        config=ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": threshold}),
    )
    return {n: p.untyped_storage().size() for n, p in engine.module.named_parameters()}


def test_small_parameters_persist_whole_in_stage3():
    # 100 elements: the norm weights (64) stay whole on every rank, the matrices are partitioned
    ref_losses, ref_state = reference_training(global_batches(STEPS, 8))
    for losses, state in run_ranks(_persistent, 2, 100):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5
    sizes = run_ranks(_whole_params, 2, 100)[0]
    assert sizes["layers.0.attn_norm.weight"] > 0 and sizes["norm.weight"] > 0  # bytes held
    assert sizes["layers.0.attn.wq.weight"] == 0 and sizes["tok_emb.weight"] == 0


# ---- regressions found in review ---------------------------------------------------------------
def _freed_during_forward():
    engine, *_ = zerotron.initialize(
        model=make_model(),
        config=ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}),
    )
    x, y = global_batches(1, 2)[0]
    loss = engine(x, y)  # training forward: autograd saves views of the weights
    held = [u.bucket.full.untyped_storage().size() for u in engine.states.units[:-1]]
    engine.backward(loss)
    engine.step()
    return held


def test_stage3_frees_block_memory_after_a_training_forward():
    for held in run_ranks(_freed_during_forward, 2):
        assert held == [0] * len(held)


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, h, use_b: bool):
        h = torch.tanh(self.a(h))
        return h + self.b(h) if use_b else h


class Branchy(nn.Module):
    """The last block's second layer runs only for some inputs: ranks differ in what gets a grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(TwoLayer() for _ in range(3))

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            h = blk(h, i < 2 or bool(tokens.sum() % 2 == 0))
        return F.cross_entropy((h @ self.embed.weight.t()).view(-1, 64), targets.view(-1))


def _branchy(stage):
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = Branchy()
    engine, *_ = zerotron.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    for b in _awkward_batches(4, 2 * dp):
        engine.train_batch(iter(micro_batches(b, rank, dp, 1)))
    return zerotron.zero.consolidated_state_dict(engine.module)


def test_parameters_unused_on_some_ranks_only():
    expected = run_ranks(_branchy, 2, 0)[0]
    for state in run_ranks(_branchy, 2, 3, timeout=60):
        assert max_weight_diff(state, expected) < 1e-6


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


def _two_backwards_stage1():
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization={"stage": 1}))
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.backward(engine(x, y))


def test_stage1_second_boundary_backward_is_a_clear_error():
    with pytest.raises(RankError, match="call engine.step"):
        run_ranks(_two_backwards_stage1, 2)
