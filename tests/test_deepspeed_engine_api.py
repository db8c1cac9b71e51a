"""The engine and ZeRO-3 surface DeepSpeed scripts touch besides the training verbs: accessors,
no_sync, moving optimizer states, destroy, attributes passed through to the model, and ZeRO-3
parameters read outside forward (placeholders, ds_* attributes, GatheredParameters(enabled=))."""

import pytest
import torch
import torch.nn as nn
from distributed import RankError, run_ranks
from parity import assert_losses_close, ds_config, global_batches, make_model, micro_batches, reference_training

import zerotron

Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


def _released_parameter_reads():
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(1, 1, zero_optimization=Z3))
    p = engine.module.layers[0].attn.wq.weight
    out = {
        "shape": tuple(p.shape),
        "ds_shape": tuple(p.ds_shape),
        "ds_numel": p.ds_numel,
        "status": p.ds_status.name,
        "sum": float(p.detach().sum()),
        "ds_tensor": p.ds_tensor.numel(),
        "ids_unique": len({q.ds_id for q in engine.module.parameters()}) == len(list(engine.module.parameters())),
    }
    with zerotron.zero.GatheredParameters([p], enabled=False):  # a plain block: nothing gathered, no crash
        out["disabled"] = tuple(p.shape)
    with zerotron.zero.GatheredParameters([p]):
        out["gathered"] = (tuple(p.shape), p.ds_status.name)
        whole = p.detach().clone()
    out["after"] = (tuple(p.shape), p.ds_status.name)
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x[:1], y[:1]))
    engine.step()
    with zerotron.zero.GatheredParameters([p]):
        out["changed_by_step"] = not torch.equal(whole, p.detach())
    from zerotron.compat.runtime.zero.partition_parameters import ZeroParamStatus

    out["status_is_deepspeeds"] = p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    return out


def test_a_released_zero3_parameter_reads_as_an_empty_placeholder_with_deepspeeds_attributes():
    # before: reading one segfaulted (a view into freed storage), and enabled=False crashed in __exit__
    outs = run_ranks(_released_parameter_reads, 2)
    assert sum(out["ds_tensor"] for out in outs) == 4096  # the ranks' parts of it (whole buckets are split)
    for out in outs:
        assert out["shape"] == (0,) and out["sum"] == 0.0 and out["status"] == "NOT_AVAILABLE"
        assert out["ds_shape"] == (64, 64) and out["ds_numel"] == 4096
        assert out["ids_unique"] and out["disabled"] == (0,)
        assert out["gathered"] == ((64, 64), "AVAILABLE") and out["after"] == ((0,), "NOT_AVAILABLE")
        assert out["changed_by_step"] and out["status_is_deepspeeds"]


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


class _MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = _Experts()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.moe(x)).square().mean()


def _units(leaf: bool):
    from zerotron.utils import set_z3_leaf_modules

    torch.manual_seed(0)
    model = _MoEModel()
    if leaf:
        set_z3_leaf_modules(model, [_Experts])
    engine, *_ = zerotron.initialize(model=model, config=ds_config(1, 1, zero_optimization=Z3))
    return [u.name for u in engine.states.units]


def test_z3_leaf_modules_are_gathered_as_one_unit():
    assert run_ranks(_units, 1, False)[0] == ["moe.experts.0", "moe.experts.1", "moe.experts.2", ""]
    assert run_ranks(_units, 1, True)[0] == ["moe", ""]


def _no_sync(stage):
    world, steps = 2, 2
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization={"stage": stage}))
    losses = []
    for batch in global_batches(steps, 4 * world):
        micro = micro_batches(batch, engine.coords.dp, world, 2)
        with engine.no_sync():  # accumulate the first half locally, reduce everything with the second
            first = engine(*micro[0])
            engine.backward(first / 2)
            try:
                engine.step()
            except RuntimeError as e:
                inside = str(e)
        second = engine(*micro[1])
        engine.backward(second / 2)
        engine.step()
        losses.append((first.item() + second.item()) / 2)
    means = [torch.tensor(v) for v in losses]
    for m in means:
        engine.dp_comm.all_reduce(m)
    return [m.item() / world for m in means], inside, engine.was_step_applied()


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_and_the_next_backward_reduces(stage):
    ref, _ = reference_training(global_batches(2, 8))
    for losses, inside, applied in run_ranks(_no_sync, 2, stage):
        assert_losses_close(losses, ref, rtol=1e-5)
        assert "inside no_sync context manager" in inside and applied


def _no_sync_stage2():
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization={"stage": 2}))
    with engine.no_sync():
        pass


def test_no_sync_is_refused_where_gradients_are_partitioned():
    with pytest.raises(RankError, match="no_sync context manager is incompatible with ZeRO stage 2"):
        run_ranks(_no_sync_stage2, 1)


def _accessors_and_states():
    from zerotron.ops.adam import FusedAdam

    model = make_model()
    engine, optimizer, *_ = zerotron.initialize(
        model=model,
        optimizer=FusedAdam(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False}, "zero_optimization": {"stage": 1}},
    )
    x, y = global_batches(3, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    out = {
        "name": engine.optimizer_name(),
        "bf16": engine.bfloat16_enabled(),
        "applied": engine.was_step_applied(),
        "overflow": optimizer.overflow,
        "group_size": torch.distributed.get_world_size(engine.data_parallel_group),
        "passthrough": engine.config is engine.__dict__["config"] and engine.tok_emb is model.tok_emb,
        "model_method": engine.num_params() if hasattr(model, "num_params") else None,
    }
    before = {k: v.clone() for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    engine.offload_states()
    out["on_host"] = all(
        v.device.type == "cpu" for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    engine.reload_states()
    after = {k: v for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    out["reloaded_equal"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    try:
        engine.offload_states(include=["lp_params"])
    except NotImplementedError as e:
        out["refused"] = str(e)
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    out["samples_per_s"] = engine.tput_timer.avg_samples_per_sec()
    hooks_before = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    engine.destroy()
    out["hooks"] = (hooks_before, sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()))
    out["state_cleared"] = len(optimizer.state) == 0
    try:
        engine(x, y)
    except RuntimeError as e:
        out["after_destroy"] = str(e)
    return out


def test_engine_accessors_offload_states_and_destroy():
    for out in run_ranks(_accessors_and_states, 2):
        assert out["name"] == "FusedAdam" and out["bf16"] is False and out["applied"] and out["overflow"] is False
        assert out["group_size"] == 2 and out["passthrough"]
        assert out["on_host"] and out["reloaded_equal"] and "optim_states" in out["refused"]
        assert out["samples_per_s"] > 0
        assert out["hooks"][0] > 0 and out["hooks"][1] == 0 and out["state_cleared"]
        assert "engine was destroyed" in out["after_destroy"] and "eval_on_start=True" in out["after_destroy"]


class _Mpu:
    def __init__(self, tp):
        self.tp = tp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_rank(self):
        return 0


def _with_mpu(tp):
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(1, 1), mpu=_Mpu(tp))
    return engine.dp_world_size


def test_initialize_takes_a_megatron_mpu_of_data_parallel_ranks_and_refuses_a_presplit_model():
    assert run_ranks(_with_mpu, 2, 1) == [2, 2]
    with pytest.raises(RankError, match="describes 2 tensor-parallel ranks but tensor_parallel.autotp_size is 1"):
        run_ranks(_with_mpu, 2, 2)


def _without_optimizer():
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    engine, optimizer, _, scheduler = zerotron.initialize(model=make_model(), config=config)
    x, y = global_batches(1, 2)[0]
    with torch.no_grad():
        loss = engine(x, y).item()  # evaluation works
    engine.backward(engine(x, y))
    try:
        engine.step()
    except zerotron.ConfigError as e:
        refused = str(e)
    return optimizer, scheduler, loss, refused


def test_an_engine_without_an_optimizer_evaluates_returns_none_and_refuses_to_step():
    optimizer, scheduler, loss, refused = run_ranks(_without_optimizer, 1)[0]
    assert optimizer is None and scheduler is None and loss > 0  # DeepSpeed's initialize returns None too
    assert "without an optimizer" in refused and "optimizer=" in refused
