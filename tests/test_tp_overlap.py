"""tensor_parallel.tp_overlap_comm: each attention and MLP block runs its micro-batch in two halves,
one half's collective in flight while the other half computes, in forward and backward. Same
training as plain tensor parallelism and as one process; half of the blocks' collectives overlap a
matmul (the other half, one per block and direction, is the exposed tail); the same bytes."""

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from parity import (
    SEQ,
    assert_losses_close,
    ds_config,
    global_batches,
    make_model,
    max_weight_diff,
    micro_batches,
    reference_training,
)
from torch.utils._python_dispatch import TorchDispatchMode

import zerotron
from zerotron.config import Config
from zerotron.errors import ConfigError

STEPS, LAYERS = 3, 2
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class Matmuls(TorchDispatchMode):
    """Counts the matmuls this thread runs (forward, and backward: on CPU autograd runs it here)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def _watch(comm, matmuls, log):
    """Every collective issued on `comm`: ("issued", kind) when synchronous; for an asynchronous
    one, at its wait, whether any matmul ran while it was in flight."""
    for kind in ("all_reduce", "all_gather_flat", "reduce_scatter_flat"):
        issue = getattr(comm, kind)

        def watched(*args, _issue=issue, _kind=kind, **kwargs):
            work = _issue(*args, **kwargs)
            if not kwargs.get("async_op"):
                log.append((_kind, False))
                return work
            start, wait = matmuls.count, work.wait

            def waited(*a):
                log.append((_kind, matmuls.count > start))
                work.wait = wait
                return wait(*a)

            work.wait = waited
            return work

        setattr(comm, kind, watched)


def _train(tp, overlap, sp=False, gas=1, stage=0, policy="none", micro=2):
    world = dist.get_world_size()
    config = ds_config(
        micro,
        gas,
        tensor_parallel={"autotp_size": tp, "tp_overlap_comm": overlap},
        zerotron={"sequence_parallel": sp, "checkpoint_policy": policy},
        zero_optimization={"stage": stage},
    )
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4, n_layer=LAYERS), config=config)
    dp, dp_rank = world // tp, engine.coords.dp
    matmuls, log = Matmuls(), []
    _watch(engine.tp_comm, matmuls, log)
    losses = []
    for i, b in enumerate(global_batches(STEPS, micro * gas * dp)):
        if i == STEPS - 1:
            log.clear()
            engine.reset_comm_stats()
        with matmuls:
            losses.append(engine.train_batch(iter(micro_batches(b, dp_rank, dp, gas))).item())
    stats = engine.tp_comm.stats()
    x = global_batches(1, 1)[0][0]
    with torch.no_grad():  # one sequence: nothing to split, the block runs whole
        logits = engine(x)
    return {
        "losses": losses,
        "weights": zerotron.zero.consolidated_state_dict(engine.module),
        "stats": stats,
        "log": log,
        "logits": logits,
    }


def _both(tp, sp=False, gas=1, stage=0, policy="none"):
    return _train(tp, False, sp, gas, stage, policy), _train(tp, True, sp, gas, stage, policy)


@pytest.mark.parametrize(
    "world,tp,sp,gas,stage,policy",
    [
        (2, 2, False, 1, 0, "none"),
        (2, 2, True, 2, 0, "none"),
        (4, 2, False, 1, 1, "none"),
        (4, 2, True, 1, 2, "every_block"),
        (4, 2, False, 2, 3, "none"),
        (4, 4, False, 1, 0, "none"),
    ],
)
def test_overlap_trains_as_plain_tensor_parallelism_and_one_process(world, tp, sp, gas, stage, policy):
    dp = world // tp
    ref_losses, ref_state = reference_training(global_batches(STEPS, 2 * gas * dp), n_kv_head=4, n_layer=LAYERS)
    for plain, overlapped in run_ranks(_both, world, tp, sp, gas, stage, policy, timeout=120):
        assert_losses_close(overlapped["losses"], plain["losses"], rtol=1e-5)
        assert_losses_close(overlapped["losses"], ref_losses, rtol=1e-5)
        assert max_weight_diff(overlapped["weights"], plain["weights"]) < 1e-5
        assert max_weight_diff(overlapped["weights"], ref_state) < 1e-5
        extra = dict.fromkeys(plain["stats"], 0)
        if policy == "every_block":  # the recomputed forward stops after the last tensor backward needs:
            # before the MLP's exit, or, in halves, after the first half's (half a micro-batch per block)
            extra["reduce_scatter" if sp else "all_reduce"] = LAYERS * 1 * SEQ * 64 * 4
        assert overlapped["stats"] == {k: v + extra[k] for k, v in plain["stats"].items()}  # the same bytes
        torch.testing.assert_close(overlapped["logits"], plain["logits"], rtol=1e-5, atol=1e-5)


def _spans_alive_after_steps(steps=3):
    """How many of overlap's per-call Span handles are still alive after each training step (they
    join a block's two halves to the autograd graph: one kept past its step would keep the step's
    activations and graph with it)."""
    import gc

    from zerotron.tensor_parallel.overlap import Span

    engine, *_ = zerotron.initialize(
        model=make_model(n_kv_head=4, n_layer=LAYERS),
        config=ds_config(2, 1, tensor_parallel={"autotp_size": 2, "tp_overlap_comm": True}),
    )
    alive = []
    for b in global_batches(steps, 2):
        engine.train_batch(iter(micro_batches(b, 0, 1, 1)))
        gc.collect()
        alive.append(sum(isinstance(o, Span) for o in gc.get_objects()))
    return alive


def test_nothing_of_a_step_outlives_it():
    for alive in run_ranks(_spans_alive_after_steps, 2):
        # at most the last step's (its graph lives while the engine keeps its loss): an entry and an
        # exit for each of 2 halves of 2 blocks per layer; never more as steps go by
        assert alive == [2 * 2 * 2 * LAYERS] * 3


def _pipeline(overlap):
    from zerotron.parallelize import to_pipeline

    module = to_pipeline(make_model(n_kv_head=4, n_layer=LAYERS), 2, partition_method="type:_PipeBlock")
    config = ds_config(2, 2, tensor_parallel={"autotp_size": 2, "tp_overlap_comm": overlap})
    engine, *_ = zerotron.initialize(model=module, config=config)
    losses = [engine.train_batch(iter(micro_batches(b, 0, 1, 2))).item() for b in global_batches(STEPS, 4)]
    return losses, zerotron.zero.consolidated_state_dict(engine.module)


def test_overlap_inside_pipeline_stages():
    plain = run_ranks(_pipeline, 4, False)
    for (losses, state), (want, want_state) in zip(run_ranks(_pipeline, 4, True), plain):
        assert_losses_close(losses, want, rtol=1e-5)
        assert max_weight_diff(state, want_state) < 1e-5


@pytest.mark.parametrize("sp", [False, True])
def test_half_of_the_block_collectives_run_under_a_matmul(sp):
    for plain, overlapped in run_ranks(_both, 2, 2, sp):
        assert not any(hidden for _, hidden in plain["log"])  # plain: each waited on as soon as issued
        hidden = [kind for kind, h in overlapped["log"] if h]
        # per block (attention, MLP) and direction: forward, half 0's exit under half 1 (and with
        # sequence parallelism half 1's gather under half 0); backward, half 1's entry under half 0
        # (and half 0's gradient gather under half 1)
        per_region = 2 if sp else 1
        assert len(hidden) == LAYERS * 2 * 2 * per_region
        blocks = len(hidden) * 2  # as many more issued and waited on at once: the exposed half
        assert len(overlapped["log"]) - len(plain["log"]) == blocks // 2
        if sp:
            assert sorted(set(hidden)) == ["all_gather_flat", "reduce_scatter_flat"]
        else:
            assert set(hidden) == {"all_reduce"}


def _config(tp=2, micro=2, **tensor_parallel):
    return Config.load(ds_config(micro, 1, tensor_parallel={"autotp_size": tp, **tensor_parallel}), world_size=2)


def test_overlap_where_it_cannot_apply_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel.tp_overlap_comm.*autotp_size is 1"):
        _config(tp=1, tp_overlap_comm=True)
    with pytest.raises(ConfigError, match="tensor_parallel.tp_overlap_comm.*train_micro_batch_size_per_gpu is 1"):
        _config(micro=1, tp_overlap_comm=True)
    assert _config(tp_overlap_comm=True).tensor_parallel.tp_overlap_comm


class _Biased(torch.nn.Module):
    """A block whose row layer has a bias (added after the sum): not splittable into halves."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))

    def tensor_parallel_plan(self, tp):
        return {"mlp.0": "column", "mlp.1": "row", "mlp": "region"}

    def forward(self, x, y):
        return (self.mlp(x) - y).square().mean()


class _NoRegion(_Biased):
    def tensor_parallel_plan(self, tp):
        return {"mlp.0": "column", "mlp.1": "row"}


def _initialize(model_class):
    zerotron.initialize(
        model=model_class(), config=ds_config(2, 1, tensor_parallel={"autotp_size": 2, "tp_overlap_comm": True})
    )


@pytest.mark.parametrize(
    "model_class,message",
    [(_NoRegion, 'marks no "region"'), (_Biased, "exactly one row-parallel layer without a bias")],
)
def test_a_plan_without_fitting_regions_is_refused(model_class, message):
    with pytest.raises(RankError, match=f"tensor_parallel.tp_overlap_comm.*{message}"):
        run_ranks(_initialize, 2, model_class)
