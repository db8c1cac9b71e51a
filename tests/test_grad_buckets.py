"""How the boundary's gradient reduction is cut into buckets and launched (stages 0-2): with
reduce_bucket_size unset, about eight buckets whatever the model's size, launched in backward order
while backward still runs, each reduced once; a configured reduce_bucket_size keeps DeepSpeed's
meaning (here 5e8: the whole tiny model is one bucket, reduced only after backward)."""

import pytest
import torch.distributed as dist
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
from zerotron.zero.flat import OVERLAP_BUCKETS

STEPS, GAS = 3, 2


def _train(stage, zero_extra):
    """STEPS steps of GAS micro-batches; every launch of the last step's boundary reduction recorded
    with how many gradients had arrived by then, and every reduction collective counted."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    zero = {"stage": stage, **zero_extra}
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, GAS, zero_optimization=zero))
    reducer = engine.states.grad_buckets if stage == 0 else engine.states
    params = [p for p in engine.module.parameters() if p.requires_grad]
    arrived, launches, collectives = [0], [], [0]
    for p in params:  # registered after the engine's hooks: counts a gradient once the engine has taken it
        p.register_post_accumulate_grad_hook(lambda p: arrived.__setitem__(0, arrived[0] + 1))
    launch = reducer._launch

    def recording_launch(bucket, in_backward):
        launches.append((bucket.index, in_backward, arrived[0]))
        return launch(bucket, in_backward)

    reducer._launch = recording_launch
    kind = "all_reduce" if stage == 0 else "reduce_scatter_flat"
    comm = reducer.groups.dense.reduce
    issue = getattr(comm, kind)

    def counting(*args, **kwargs):
        collectives[0] += 1
        return issue(*args, **kwargs)

    setattr(comm, kind, counting)
    losses = []
    for i, batch in enumerate(global_batches(STEPS, 2 * GAS * dp)):
        last = i == STEPS - 1
        for j, (x, y) in enumerate(micro_batches(batch, rank, dp, GAS)):
            if last and j == GAS - 1:  # the boundary backward of the last step
                arrived[0], launches[:], collectives[0] = 0, [], 0
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
    sizes = [sum(p.numel() for p in b.params) for b in reducer.buckets]
    return {
        "losses": losses,
        "weights": zerotron.zero.consolidated_state_dict(engine.module),
        "launches": launches,
        "collectives": collectives[0],
        "sizes": sizes,
        "gradients": len(params),
        "total": sum(p.numel() for p in params),
    }


def _sweep(stage):
    return {
        name: _train(stage, extra) for name, extra in (("default", {}), ("one_bucket", {"reduce_bucket_size": 5e8}))
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unset_bucket_size_overlaps_the_boundary_reduction_with_backward(stage):
    dp = 2
    _, ref = reference_training(global_batches(STEPS, 2 * GAS * dp))
    for out in run_ranks(_sweep, dp, stage):
        default, one = out["default"], out["one_bucket"]
        n = len(default["sizes"])
        # about eight buckets of at most an eighth of the model (a parameter is never split)
        assert OVERLAP_BUCKETS <= n <= OVERLAP_BUCKETS + 3
        assert max(default["sizes"]) <= -(-default["total"] // OVERLAP_BUCKETS)
        # launched in bucket (= backward) order, each once, each as the backward fills it: all but
        # the last while gradients were still to come, the first before half of them had arrived
        assert [i for i, _, _ in default["launches"]] == list(range(n))
        assert all(in_backward for _, in_backward, _ in default["launches"])
        seen = [a for _, _, a in default["launches"]]
        assert seen == sorted(seen) and seen[0] < default["gradients"] / 2
        assert all(a < default["gradients"] for a in seen[:-1])
        # stage 2 reduces every micro-batch; the boundary backward issues one collective per bucket
        assert default["collectives"] == n
        # reduce_bucket_size set keeps DeepSpeed's meaning: 5e8 holds this model in one bucket,
        # whose reduction starts only once every gradient is in
        assert one["sizes"] == [default["total"]]
        assert [(i, a) for i, _, a in one["launches"]] == [(0, one["gradients"] - 1)]
        assert one["collectives"] == 1
        # and the math is the same (the clipping norm is summed over other pieces: not bit for bit)
        assert_losses_close(default["losses"], one["losses"], rtol=1e-6)
        assert max_weight_diff(default["weights"], ref) < 1e-5
