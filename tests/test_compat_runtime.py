"""The `deepspeed.runtime` surface (zerotron/compat): schedulers, the config, constants, external parameters,
topology, the loss scaler and the data loader; what scripts import from it does what it does under
DeepSpeed, on zerotron's engines."""

import argparse

import pytest
import torch
from parity import LR, ds_config, make_model

import zerotron
from zerotron.compat import runtime
from zerotron.compat.runtime import lr_schedules


# ---- runtime: schedulers, config, constants, topology, loss scaler -------------------------------------
def test_lr_schedules_are_zerotrons_and_step_like_them():
    assert lr_schedules.WarmupLR is zerotron.schedulers.WarmupLR
    assert lr_schedules.OneCycle is zerotron.schedulers.OneCycle
    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (
        lr_schedules.WARMUP_MIN_LR,
        lr_schedules.WARMUP_MAX_LR,
        lr_schedules.WARMUP_NUM_STEPS,
        lr_schedules.TOTAL_NUM_STEPS,
    ) == ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_schedules.WarmupDecayLR(
        opt, total_num_steps=10, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear"
    )
    lrs = []
    for _ in range(11):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    want = [0.1 * i / 4 for i in range(4)] + [0.1 * (10 - i) / 6 for i in range(4, 11)]
    assert lrs == pytest.approx(want)


def test_lr_range_test_grows_the_lr_continuously_or_in_stairs():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_schedules.LRRangeTest(
        opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0
    )
    assert opt.param_groups[0]["lr"] == 0.01 and sched.get_last_lr() == [0.01]
    got = []
    for _ in range(6):
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx([0.01 * (1 + 2.0 * (i + 1) / 4) for i in range(6)])
    stairs = lr_schedules.LRRangeTest(
        opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_staircase=True
    )
    got = []
    for _ in range(8):
        stairs.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx([0.01] * 3 + [0.02] * 4 + [0.03])
    assert stairs.state_dict() == {"last_batch_iteration": 7}
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        lr_schedules.LRRangeTest(opt, lr_range_test_step_size=0)


def test_tuning_arguments_give_a_scheduler_config():
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_max_lr", "0.5", "--warmup_num_steps", "7"])
    config, error = lr_schedules.get_config_from_args(args)
    assert error is None
    assert config == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.5, "warmup_num_steps": 7, "warmup_type": "log"},
    }
    assert lr_schedules.get_lr_from_config(config) == (0.5, "")
    assert parser.parse_args(["--lr_range_test_staircase", "false"]).lr_range_test_staircase is False
    assert lr_schedules.get_config_from_args(parser.parse_args([]))[0] is None


def test_deepspeed_config_reads_a_config_with_deepspeeds_names():
    cfg = runtime.config.DeepSpeedConfig(ds_config(2, 3, zero_optimization={"stage": 2}, bf16={"enabled": True}))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (6, 2, 3)
    assert (cfg.zero_optimization_stage, cfg.zero_enabled, cfg.bfloat16_enabled, cfg.fp16_enabled) == (
        2,
        True,
        True,
        False,
    )
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params["lr"] == LR and cfg.world_size == 1
    assert cfg.zero_config.stage == 2 and cfg.model_dtype_name == "bf16"  # zerotron.Config's own attributes too
    assert runtime.config.DeepSpeedConfigError is zerotron.ConfigError
    with pytest.raises(runtime.config.DeepSpeedConfigError, match="gradient_clipping"):
        runtime.config.DeepSpeedConfig(ds_config(2, 1, clip=-1.0))
    c = runtime.constants
    assert (
        c.TRAIN_BATCH_SIZE,
        c.GRADIENT_ACCUMULATION_STEPS,
        c.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
        c.FP16,
        c.BFLOAT16,
        c.GRADIENT_CLIPPING,
        c.ZERO_OPTIMIZATION,
    ) == (
        "train_batch_size",
        "gradient_accumulation_steps",
        "train_micro_batch_size_per_gpu",
        "fp16",
        "bf16",
        "gradient_clipping",
        "zero_optimization",
    )
    assert runtime.engine.DeepSpeedEngine is zerotron.Engine and runtime.engine.ADAMW_OPTIMIZER == "adamw"
    assert runtime.pipe.PipelineModule is zerotron.pipe.PipelineModule
    assert runtime.pipe.engine.PipelineEngine.__name__ == "PipelineEngine"
    assert (
        runtime.zero.Init is zerotron.zero.Init and runtime.zero.GatheredParameters is zerotron.zero.GatheredParameters
    )
    status = runtime.zero.partition_parameters.ZeroParamStatus
    assert (status.AVAILABLE.value, status.NOT_AVAILABLE.value, status.INFLIGHT.value) == (1, 2, 3)
    assert runtime.activation_checkpointing.checkpointing is zerotron.checkpointing


def test_register_external_parameter_is_recorded():
    model = make_model()
    runtime.zero.register_external_parameter(model.layers[1], model.tok_emb.weight)
    assert model.layers[1]._external_params == {id(model.tok_emb.weight): model.tok_emb.weight}
    runtime.zero.partition_parameters.unregister_external_parameter(model.layers[1], model.tok_emb.weight)
    assert model.layers[1]._external_params == {}
    with pytest.raises(RuntimeError, match="Parameter"):
        runtime.zero.register_external_parameter(model, torch.zeros(2))


def test_pipe_topology_names_zerotrons_ranks():
    from zerotron.topology import Topology

    topo = runtime.pipe.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    ours = Topology(12, tp=2, pp=2)
    for rank in range(12):
        c = topo.get_coord(rank)
        assert topo.get_rank(pipe=c.pipe, data=c.data, model=c.model) == rank
        assert ours.rank_of(pp=c.pipe, dp=c.data, tp=c.model) == rank
    for axis, dim in (("pipe", "pp"), ("data", "dp"), ("model", "tp")):
        assert sorted(map(tuple, topo.get_axis_comm_lists(axis))) == sorted(
            {tuple(ours.group_ranks(dim, r)) for r in range(12)}
        )
    assert topo.filter_match(pipe=0, data=1) == [2, 3] and topo.get_dim("model") == 2 and topo.get_dim("x") == 0
    assert topo.get_rank_repr(rank=3) == "model_01" and topo.world_size() == 12
    assert runtime.pipe.PipeDataParallelTopology(2, 2).get_axis_list("pipe", 1) == [2, 3]


def test_dynamic_loss_scaler_steps_like_zerotrons():
    from zerotron.config import FP16Config
    from zerotron.precision import LossScaler

    ds = runtime.fp16.loss_scaler.DynamicLossScaler(
        init_scale=2**6, scale_window=2, min_scale=2, delayed_shift=2, consecutive_hysteresis=False
    )
    ours = LossScaler(
        FP16Config(enabled=True, initial_scale_power=6, loss_scale_window=2, hysteresis=2, min_loss_scale=2)
    )
    for overflow in [True, True, False, False, False, True, True, False, True]:
        ds.update_scale(overflow)
        ours.update(overflow)
        assert (ds.cur_scale, ds.cur_hysteresis, ds.cur_iter) == (ours.scale, ours.hysteresis_left, ours.iteration)
    assert ds.loss_scale == ds.cur_scale and float(ds.scale_loss(torch.tensor(1.0))) == ds.cur_scale
    static = runtime.fp16.loss_scaler.LossScaler(scale=128)
    static.update_scale(True)
    assert static.loss_scale == 128 and not static.has_overflow([])
    quiet = runtime.fp16.loss_scaler.DynamicLossScaler(
        init_scale=2,
        scale_window=10,
        min_scale=2,
        delayed_shift=1,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=False,
    )
    quiet.update_scale(True)
    assert quiet.cur_scale == 2 and quiet.cur_iter == 1


def test_deepspeed_dataloader_reads_this_ranks_share():
    data = torch.utils.data.TensorDataset(torch.arange(8))
    loader = runtime.dataloader.DeepSpeedDataLoader(
        data,
        batch_size=2,
        pin_memory=False,
        local_rank=0,
        tput_timer=None,
        data_parallel_world_size=2,
        data_parallel_rank=1,
    )
    assert len(loader) == 2
    seen = sorted(int(v) for (batch,) in loader for v in batch)
    assert len(seen) == 4 and set(seen) < set(range(8))


def test_move_to_device_moves_nested_tensors_and_keeps_the_rest():
    from zerotron.compat.runtime.utils import move_to_device

    t = torch.ones(2, dtype=torch.float64)
    out = move_to_device({"a": [t, (t, 3)], "b": "text"}, torch.device("cpu"))
    assert out["b"] == "text" and out["a"][1][1] == 3 and torch.equal(out["a"][0], t)
    kept = move_to_device([t], "cpu", criterion_func=lambda x: torch.is_tensor(x))
    assert kept[0] is t  # the criterion's tensors keep their identity (their storage moves)
