"""ZeRO-3's DeepSpeed knobs that trade memory for communication, each measured:
stage3_max_reuse_distance (a unit whose backward comes within that many parameter elements of
its forward stays gathered in between: fewer all-gathers) and stage3_max_live_parameters
(prefetching stops while that many elements are gathered: a lower peak), stage3_prefetch_bucket_size
(how many elements are gathered ahead of their use: the prefetch depth), and sub_group_size
(the fp32 gradient copy and the optimizer step one sub-group at a time: a smaller copy). None
changes the math."""

import torch.distributed as dist
from distributed import run_ranks
from parity import ds_config, global_batches, make_model, micro_batches

import zerotron


def _measure(zero_extra: dict, steps: int = 3):
    """Train `steps` steps (the first records the order); measure the last one."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **zero_extra}
    engine, *_ = zerotron.initialize(model=make_model(n_layer=4), config=ds_config(1, 1, zero_optimization=zero))
    losses = []
    for i, b in enumerate(global_batches(steps, dp)):
        if i == steps - 1:
            engine.reset_comm_stats()
            engine.states.peak_live_numel = engine.states.peak_ahead_numel = engine.states.prefetch_hits = 0
        losses.append(engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item())
    states = engine.states
    blocks = [u for u in states.units if u is not states.root_unit and u.bucket is not None]
    return {
        "losses": losses,
        "gathered": engine.comm_stats()["all_gather"],
        "peak": states.peak_live_numel,
        "ahead": states.peak_ahead_numel,
        "hits": states.prefetch_hits,
        "block_bytes": [u.numel * u.bucket.full.element_size() for u in blocks],
        "block_numel": [u.numel for u in blocks],
        "root": states.root_unit.numel,
    }


def _sweep():
    return {
        name: _measure(extra)
        for name, extra in {
            "release": {"stage3_max_reuse_distance": 0},
            "keep_last": {"stage3_max_reuse_distance": 1},
            "keep_all": {"stage3_max_reuse_distance": 10**9},
            "no_prefetch": {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1},
        }.items()
    }


def test_reuse_distance_and_live_cap_change_communication_and_peak_not_the_math():
    for out in run_ranks(_sweep, 2, timeout=180):
        release, keep_last, keep_all, no_prefetch = (
            out[k] for k in ("release", "keep_last", "keep_all", "no_prefetch")
        )
        assert release["losses"] == keep_last["losses"] == keep_all["losses"] == no_prefetch["losses"]
        blocks = release["block_bytes"]
        assert len(blocks) == 4
        # distance 0: every block gathered for its forward and again for its backward
        assert release["gathered"] - keep_all["gathered"] == sum(blocks)
        # distance 1: only the last block (its backward follows at once) stays gathered
        assert release["gathered"] - keep_last["gathered"] == blocks[-1]
        # the live cap stops prefetching: the root and one block at a time
        assert no_prefetch["peak"] == no_prefetch["root"] + max(no_prefetch["block_numel"])
        assert release["peak"] > no_prefetch["peak"]
        # kept units stay gathered through the forward: the peak holds every block
        assert keep_all["peak"] == keep_all["root"] + sum(keep_all["block_numel"])


def _prefetch_sweep():
    block = _measure({})["block_numel"][0]  # the blocks are alike
    return block, {
        name: _measure({"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": size})
        for name, size in (("none", 0), ("one", 1), ("two", 2 * block), ("default", 5e7))
    }


def test_prefetch_bucket_size_sets_how_far_ahead_units_are_gathered_not_the_math():
    for block, out in run_ranks(_prefetch_sweep, 2, timeout=180):
        none, one, two, default = (out[k] for k in ("none", "one", "two", "default"))
        assert none["losses"] == one["losses"] == two["losses"] == default["losses"]
        assert none["gathered"] == one["gathered"] == two["gathered"] == default["gathered"]  # the same gathers
        # 0: nothing is gathered before its unit runs
        assert none["hits"] == 0 and none["ahead"] == 0
        # 1 element: the next unit only (prefetching goes on while less than the size is ahead)
        assert one["ahead"] == block
        # two blocks' worth: two units ahead at most
        assert two["ahead"] == 2 * block
        # 5e7 (DeepSpeed's default): every block of this small model ahead at the forward's start
        assert default["ahead"] == 4 * block
        # with any prefetch every block's forward and backward gather was issued ahead of its use
        for run in (one, two, default):
            assert run["hits"] == 2 * 4
        assert none["peak"] < one["peak"] < two["peak"] < default["peak"]


def _forward_decisions(zero_extra: dict):
    """The second step's forward (the first records the order): at each unit's start, the units
    whose gather the engine started; after the forward, the blocks left gathered (kept for reuse)."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **zero_extra}
    engine, *_ = zerotron.initialize(model=make_model(n_layer=4), config=ds_config(1, 1, zero_optimization=zero))
    states, started = engine.states, []
    prefetch = states._prefetch

    def recording(unit, step):
        before = {u.index for u in states.units if not u.released}
        prefetch(unit, step)
        if step > 0:
            started.append(sorted(u.index for u in states.units if not u.released and u.index not in before))

    states._prefetch = recording
    (first, second), kept = global_batches(2, dp), None
    engine.train_batch(iter(micro_batches(first, rank, dp, 1)))
    started.clear()
    x, y = micro_batches(second, rank, dp, 1)[0]
    loss = engine(x, y)
    kept = [u.index for u in states.trace if not u.released]
    engine.backward(loss)
    engine.step()
    knobs = states.prefetch_numel, states.max_live_numel, states.max_reuse_numel
    return (
        started,
        kept,
        [u.index for u in states.trace],
        [u.numel for u in states.trace],
        states.root_unit.numel,
        knobs,
    )


def _decision_sweep():
    block = _measure({})["block_numel"][0]
    knobs = [
        {},
        {"stage3_prefetch_bucket_size": 0},
        {"stage3_prefetch_bucket_size": 1},
        {"stage3_prefetch_bucket_size": 2 * block},
        {"stage3_max_live_parameters": 1},
        {"stage3_max_live_parameters": 3 * block},
        {"stage3_max_reuse_distance": 1},
        {"stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 4 * block},
        {"stage3_max_reuse_distance": 5 * block, "stage3_prefetch_bucket_size": 3 * block},
    ]
    return [(extra, _forward_decisions(extra)) for extra in knobs]


def test_the_engine_and_the_planner_take_every_prefetch_and_reuse_decision_alike():
    """zero/gather_rules.py is the one home of ZeRO-3's prefetch and reuse rules: the planner's
    play of a forward (forward_plan) makes every decision the engine made, knob by knob."""
    from zerotron.zero.gather_rules import forward_plan

    seen = set()
    for extra, (started, kept, trace, numels, root, knobs) in run_ranks(_decision_sweep, 2, timeout=180)[0]:
        plan = forward_plan(numels, root, *knobs)
        assert started == [sorted(trace[j] for j in step.started) for step in plan], extra
        assert kept == [trace[i] for i, step in enumerate(plan[1:]) if step.kept], extra
        seen.add(str((started, kept)))
    assert len(seen) >= 5  # the knobs did change the decisions


def _sub_group_sweep():
    dp, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, size in (("whole", 10**9), ("sub_groups", 20_000)):
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": size}
        engine, *_ = zerotron.initialize(
            model=make_model(n_layer=4), config=ds_config(1, 1, zero_optimization=zero, bf16={"enabled": True})
        )
        losses = [engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item() for b in global_batches(3, dp)]
        runs = [m.numel() for _, m in engine.states.runs]
        out[name] = {
            "losses": losses,
            "peak": engine.states.peak_fp32_grad_numel,
            "runs": runs,
            "norm": engine.get_global_grad_norm(),
            "weights": zerotron.zero.consolidated_state_dict(engine.module),
        }
    return out


def test_sub_group_size_bounds_the_fp32_gradient_copy_not_the_math():
    import torch

    for out in run_ranks(_sub_group_sweep, 2, timeout=180):
        whole, sub = out["whole"], out["sub_groups"]
        assert whole["losses"] == sub["losses"] and whole["norm"] == sub["norm"]
        assert all(torch.equal(whole["weights"][k], sub["weights"][k]) for k in whole["weights"])
        assert whole["peak"] == sum(whole["runs"])  # the whole shard's fp32 copy at once
        assert sub["peak"] == max(sub["runs"]) < 20_000 * 2  # one sub-group (here: one run) at a time
        assert sub["peak"] < whole["peak"] / 3
