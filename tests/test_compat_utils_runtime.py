"""The `deepspeed.utils`, `deepspeed.runtime` and `deepspeed.moe.utils` surface (zerotron/compat):
what scripts import from them does what it does under DeepSpeed, on zerotron's engines."""

import argparse
import json
import logging
import random

import numpy
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from parity import EPS, LR, ds_config, global_batches, make_model, micro_batches

import zerotron
from zerotron.compat import moe, runtime, utils
from zerotron.compat.runtime import lr_schedules
from zerotron.compat.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zerotron.compat.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from zerotron.compat.utils import groups, zero_to_fp32


# ---- utils: loaders, logging, seeds, OnDevice, leaf modules -----------------------------------------
def test_repeating_loader_starts_over_when_exhausted():
    loader = torch.utils.data.DataLoader(torch.arange(5), batch_size=2, drop_last=True)
    it = utils.RepeatingLoader(loader)
    got = [next(it).tolist() for _ in range(5)]
    assert got == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert iter(it) is it and runtime.dataloader.RepeatingLoader is utils.RepeatingLoader


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


def _log_dist_on_ranks():
    handler = _Collect()
    utils.logger.addHandler(handler)
    before = utils.logger.level
    try:
        if dist.get_rank() == 1:  # zerotron's default on ranks other than 0: its own messages once
            utils.logger.setLevel(logging.WARNING)
        utils.log_dist("to one", ranks=[1])
        utils.log_dist("to all", ranks=[-1])
        utils.log_dist("to nobody")
        utils.log_dist("to zero", ranks=[0], level=logging.WARNING)
        utils.log_dist("too quiet", ranks=[-1], level=logging.DEBUG)
        utils.logging.log_dist_once("once", ranks=[0, 1])
        utils.logging.log_dist_once("once", ranks=[0, 1])
    finally:
        utils.logger.removeHandler(handler)
        utils.logger.setLevel(before)
    return handler.messages


def test_log_dist_speaks_only_on_the_named_ranks():
    r0, r1 = run_ranks(_log_dist_on_ranks, 2)
    assert r0 == [
        (logging.INFO, "[Rank 0] to all"),
        (logging.WARNING, "[Rank 0] to zero"),
        (logging.INFO, "[Rank 0] once"),
    ]
    assert r1 == [(logging.INFO, "[Rank 1] to one"), (logging.INFO, "[Rank 1] to all"), (logging.INFO, "[Rank 1] once")]
    assert utils.logging.get_dist_msg("x", ranks=None) == "[Rank -1] x"  # no process group: every rank


def test_set_random_seed_is_reproducible():
    def draws(seed):
        runtime.utils.set_random_seed(seed)
        return random.random(), float(numpy.random.rand()), torch.rand(3).tolist()

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    draws(2**70)  # larger than numpy's and torch's seed ranges: reduced, as DeepSpeed does


def test_see_memory_usage_prints_only_when_forced(capsys):
    runtime.utils.see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    runtime.utils.see_memory_usage("loud", force=True)
    out = capsys.readouterr().out
    assert out.startswith("loud\n") and "GB" in out


def test_on_device_builds_on_meta_in_the_dtype():
    with utils.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        ids = torch.zeros(3, dtype=torch.long)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert ids.dtype == torch.long and ids.is_meta  # integers keep their dtype
    assert torch.empty(2).device.type == "cpu" and torch.empty(2).dtype == torch.float32  # restored
    with utils.OnDevice(dtype=torch.bfloat16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


def test_z3_leaf_modules_are_marked_found_and_unmarked():
    model = make_model()
    block = type(model.layers[0])
    assert utils.set_z3_leaf_modules(model, [block]) == list(model.layers)
    assert utils.get_z3_leaf_modules(model) == list(model.layers)
    assert all(m._z3_leaf is True and utils.z3_leaf_module(m) for m in model.layers)
    utils.unset_z3_leaf_modules(model, ["Block"])
    assert utils.get_z3_leaf_modules(model) == []
    marked, missing = utils.set_z3_leaf_modules_by_name(model, ["layers.1", "nope"], raise_if_not_found=False)
    assert marked == [model.layers[1]] and missing == ["nope"]
    marked, _ = utils.set_z3_leaf_modules_by_suffix(model, [".mlp"])
    assert marked == [model.layers[0].mlp, model.layers[1].mlp]
    with pytest.raises(ValueError, match="no module of class"):
        utils.set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert utils.set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []


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


# ---- moe ---------------------------------------------------------------------------------------
def test_moe_param_groups_without_experts_come_back_unchanged():
    model = make_model()
    split = moe.utils.split_params_into_different_moe_groups_for_optimizer
    group = {"params": list(model.parameters()), "weight_decay": 0.1, "name": "all"}
    assert split(group) == [group] and split(group)[0]["params"] == list(model.parameters())
    groups_in = ({"params": [model.tok_emb.weight]}, {"params": (p for p in [model.norm.weight])})
    out = split(groups_in)
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["params"] == [model.tok_emb.weight] and out[1]["params"] == [model.norm.weight]
    assert not any(moe.utils.is_moe_param(p) for p in model.parameters())
    with pytest.raises(ValueError, match="param groups"):
        split("nope")


def test_moe_params_move_to_groups_of_their_own():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 5))
    b.allreduce, b.group_name = False, "ep_size_2"
    c.allreduce, c.group_name = False, "ep_size_2"
    out = moe.utils.split_params_into_different_moe_groups_for_optimizer(
        [{"params": [a, b, c], "name": "dense", "lr": 0.5}], max_group_size=6
    )
    assert [g["params"] for g in out] == [[a], [b], [c]]
    assert out[1] == {"params": [b], "name": "ep_size_2", "moe": True, "lr": 0.5} and moe.utils.is_moe_param(b)
    assert moe.utils.split_params_into_shared_and_expert_params([a, b, c]) == ([a], [b, c])
    with pytest.raises(NotImplementedError, match="not supported by zerotron"):
        moe.layer.MoE(hidden_size=8)
    assert moe.utils.has_moe_layers(make_model()) == (False, 0)


# ---- groups: answered from the latest engine's topology --------------------------------------------
def _group_answers():
    dp_group = groups._get_data_parallel_group()
    engine = utils.current_engine(required=False)
    return {
        "dp": (
            groups._get_data_parallel_world_size(),
            groups._get_data_parallel_rank(),
            list(range(dist.get_world_size()))
            if dp_group is dist.group.WORLD
            else dist.get_process_group_ranks(dp_group),
        ),
        "mp": (
            groups._get_model_parallel_world_size(),
            groups.get_tensor_model_parallel_world_size(),
            groups.get_tensor_model_parallel_rank(),
            groups.get_model_parallel_rank(),
            groups.get_tensor_model_parallel_src_rank(),
        ),
        "tp_ranks": None if engine is None else dist.get_process_group_ranks(groups.get_model_parallel_group()),
        "sp": (
            groups._get_sequence_parallel_world_size(),
            groups._get_sequence_parallel_rank(),
            groups._get_sequence_data_parallel_world_size(),
        ),
        "ep": (
            groups._get_expert_parallel_world_size("ep_size_1"),
            groups._get_expert_parallel_rank("x"),
            groups._get_expert_data_parallel_world_size("x"),
        ),
        "src": groups._get_broadcast_src_rank(),
    }


def _groups_after_initialize(tp):
    out = {"before": _group_answers()}
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, tensor_parallel={"autotp_size": tp}))
    out["found"] = _group_answers()  # found through the garbage collector's objects, not registered
    assert utils.register_engine(engine) is engine
    out["registered"] = _group_answers()
    assert utils.current_engine() is engine
    with pytest.raises(RuntimeError, match="expert"):
        groups._get_expert_parallel_group("ep_size_1")
    with pytest.raises(KeyError, match="sequence"):
        groups._get_sequence_parallel_group()
    return out


def _newest_engine_without_registration():
    from zerotron.compat.utils import engines

    walks = []
    real = engines.gc.get_objects
    engines.gc.get_objects = lambda *a: walks.append(1) or real(*a)
    try:
        first, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1))
        answers = [utils.current_engine() is first]
        second, *_ = zerotron.initialize(
            model=make_model(seed=1), config=ds_config(2, 1, zero_optimization={"stage": 1})
        )
        answers.append(utils.current_engine() is second)
        walked = len(walks)
        for _ in range(5):
            groups._get_data_parallel_world_size()
            utils.current_engine()
        answers.append(len(walks) == walked)  # nothing new was built: no second walk
        answers.append(
            isinstance(second.optimizer, DeepSpeedZeroOptimizer)
            and not isinstance(first.optimizer, DeepSpeedZeroOptimizer)
        )
        utils.register_engine(first)
        answers.append(utils.current_engine() is first)
        del first
        import gc

        gc.collect()
        answers.append(utils.current_engine() is second)  # the registered one is gone
    finally:
        engines.gc.get_objects = real
    return answers


def test_the_current_engine_is_the_newest_or_the_registered_one():
    assert run_ranks(_newest_engine_without_registration, 1) == [[True] * 6]


def test_groups_on_two_data_parallel_ranks():
    results = run_ranks(_groups_after_initialize, 2, 1)
    for rank, r in enumerate(results):
        assert r["before"]["dp"] == (2, rank, [0, 1]) and r["before"]["mp"][:2] == (1, 1)
        for when in ("found", "registered"):
            assert r[when]["dp"] == (2, rank, [0, 1])
            assert r[when]["mp"] == (1, 1, 0, 0, rank) and r[when]["tp_ranks"] == [rank]
            assert r[when]["sp"] == (1, 0, 2) and r[when]["ep"] == (1, 0, 2) and r[when]["src"] == 0


def test_groups_with_tensor_parallel_two_on_four_ranks():
    results = run_ranks(_groups_after_initialize, 4, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["before"]["dp"] == (4, rank, [0, 1, 2, 3])
        tp_rank, dp_rank = rank % 2, rank // 2
        for when in ("found", "registered"):
            assert r[when]["dp"] == (2, dp_rank, [tp_rank, tp_rank + 2]), (rank, r[when])
            assert r[when]["mp"] == (2, 2, tp_rank, tp_rank, rank - tp_rank)
            assert r[when]["tp_ranks"] == [rank - tp_rank, rank - tp_rank + 1]
            assert r[when]["src"] == tp_rank and r[when]["ep"] == (1, 0, 2)


# ---- safe_get/set_full_*: ZeRO 0-3 on two ranks against one process ------------------------------------
SET_NAMES = ("layers.0.attn.wq.weight", "layers.1.mlp_norm.weight", "lm_head.weight")


def _set_values(named_shapes):
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(shape, generator=g) * 0.05 for n, shape in named_shapes}


def _safe_functions_under_every_stage():
    from zerotron.zero import consolidated_state_dict

    batches = global_batches(2, 4)
    shapes = {n: p.shape for n, p in make_model().named_parameters()}  # (ZeRO-3 parameters read as empty)
    out = {}
    for stage in (0, 1, 2, 3):
        zero = {"stage": stage}
        if stage == 3:  # matrices partitioned, norm weights kept whole: both kinds of ZeRO-3 parameters
            zero["stage3_param_persistence_threshold"] = 100
        engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization=zero))
        rank = engine.coords.dp
        ((x, y),) = micro_batches(batches[0], rank, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
        ((x, y),) = micro_batches(batches[1], rank, 2, 1)
        engine.backward(engine(x, y))  # the second step's gradients, before its step
        params = dict(engine.module.named_parameters())
        traffic = engine.comm_stats()
        r = {
            "param": {n: utils.safe_get_full_fp32_param(p).cpu() for n, p in params.items()},
            "grad": {n: utils.safe_get_full_grad(p).cpu() for n, p in params.items()},
            "exp_avg": {n: utils.safe_get_full_optimizer_state(p, "exp_avg").cpu() for n, p in params.items()},
            "exp_avg_sq": {n: utils.safe_get_full_optimizer_state(p, "exp_avg_sq").cpu() for n, p in params.items()},
            "step": float(utils.safe_get_full_optimizer_state(params["norm.weight"], "step")),
            "missing_state": utils.safe_get_full_optimizer_state(params["norm.weight"], "nothing"),
            "local_numel": {n: utils.safe_get_local_fp32_param(p).numel() for n, p in params.items()},
            "not_ours": utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))),
            "zero3": isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3),
            "zero12": isinstance(engine.optimizer, DeepSpeedZeroOptimizer),
        }
        r["not_training_traffic"] = engine.comm_stats() == traffic
        r["consolidated"] = consolidated_state_dict(engine.module)
        # Setting: the fp32 master and the weights every rank computes with.
        values = _set_values((n, shapes[n]) for n in SET_NAMES)
        for n in SET_NAMES:
            utils.safe_set_full_fp32_param(params[n], values[n])
        x_eval, y_eval = batches[1][0][:2], batches[1][1][:2]
        with torch.no_grad():
            r["loss_after_set"] = float(engine(x_eval, y_eval))
        r["param_after_set"] = {n: utils.safe_get_full_fp32_param(params[n]).cpu() for n in SET_NAMES}
        r["consolidated_after_set"] = {
            n: v for n, v in consolidated_state_dict(engine.module).items() if n in SET_NAMES
        }
        target = params["layers.1.attn.wk.weight"]
        state = values["layers.0.attn.wq.weight"][:32] + 1.0
        utils.safe_set_full_optimizer_state(target, state, "exp_avg")
        r["state_after_set"] = utils.safe_get_full_optimizer_state(target, "exp_avg").cpu()
        utils.safe_set_full_grad(target, state * 2)
        r["grad_after_set"] = utils.safe_get_full_grad(target).cpu()
        with pytest.raises(KeyError, match="no state"):
            utils.safe_set_full_optimizer_state(target, state, "nothing")
        out[stage] = r
        del engine, params, target
    return out


def _single_process_reference():
    """One AdamW step on batch 0 (clipped), then the gradients of batch 1: what the engines hold."""
    batches = global_batches(2, 4)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1, fused=True)
    x, y = batches[0]
    model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    names = dict(model.named_parameters())
    ref = {
        "param": {n: p.detach().clone() for n, p in names.items()},
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in names.items()},
        "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in names.items()},
    }
    x, y = batches[1]
    model(x, y).backward()
    ref["grad"] = {n: p.grad.clone() for n, p in names.items()}
    return ref


@pytest.fixture(scope="module")
def safe_results():
    return run_ranks(_safe_functions_under_every_stage, 2, timeout=180), _single_process_reference()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_full_values_equal_one_process(safe_results, stage):
    results, ref = safe_results
    for rank, r in enumerate(results):
        r = r[stage]
        for n, v in r["consolidated"].items():  # exactly the full weights, on every rank
            assert torch.equal(r["param"][n], v), (stage, rank, n)
        for kind, tol in (("param", 1e-6), ("grad", 1e-6), ("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):
            for n, want in ref[kind].items():
                assert r[kind][n].shape == want.shape, (stage, kind, n)
                torch.testing.assert_close(r[kind][n], want, rtol=1e-4, atol=tol, msg=f"stage {stage} {kind} {n}")
        assert r["step"] == 1.0 and r["missing_state"] is None and r["not_ours"] is None
        assert r["zero3"] == (stage == 3) and r["zero12"] == (stage in (1, 2))
        assert r["not_training_traffic"]  # engine.comm_stats() counts training only
    total = {n: sum(results[k][stage]["local_numel"][n] for k in range(2)) for n in ref["param"]}
    numel = {n: ref["param"][n].numel() * (2 if stage == 0 else 1) for n in ref["param"]}  # stage 0: replicated
    assert total == numel


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_set_full_fp32_param_changes_the_next_forward(safe_results, stage):
    results, _ = safe_results
    model = make_model()
    model.load_state_dict(results[0][stage]["consolidated"])
    values = _set_values((n, p.shape) for n, p in model.named_parameters() if n in SET_NAMES)
    x, y = (t[:2] for t in global_batches(2, 4)[1])
    with torch.no_grad():
        before = float(model(x, y))
        for n, p in model.named_parameters():
            if n in SET_NAMES:
                p.copy_(values[n])
        want = float(model(x, y))
    for r in results:
        r = r[stage]
        assert r["loss_after_set"] == pytest.approx(want, rel=1e-6) and abs(want - before) > 1e-3
        for n in SET_NAMES:
            assert torch.equal(r["param_after_set"][n], values[n]) and torch.equal(
                r["consolidated_after_set"][n], values[n]
            )
        state = values["layers.0.attn.wq.weight"][:32] + 1.0
        assert torch.equal(r["state_after_set"], state)
        torch.testing.assert_close(r["grad_after_set"], state * 2)


def _mixed_precision_values():
    from zerotron.zero import consolidated_state_dict

    batches = global_batches(2, 4)
    out = {}
    for name, stage, precision in (
        ("bf16-0", 0, {"bf16": {"enabled": True}}),
        ("bf16-2", 2, {"bf16": {"enabled": True}}),
        ("fp16-3", 3, {"fp16": {"enabled": True, "initial_scale_power": 12}}),
    ):
        zero = {"stage": stage, "stage3_param_persistence_threshold": 100}
        engine, *_ = zerotron.initialize(
            model=make_model(), config=ds_config(2, 1, zero_optimization=zero, **precision)
        )
        ((x, y),) = micro_batches(batches[0], engine.coords.dp, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
        ((x, y),) = micro_batches(batches[1], engine.coords.dp, 2, 1)
        engine.backward(engine(x, y))
        params = dict(engine.module.named_parameters())
        out[name] = {
            "master": {n: utils.safe_get_full_fp32_param(p).cpu() for n, p in params.items()},
            "grad": {n: utils.safe_get_full_grad(p).cpu() for n, p in params.items()},
            "weights": consolidated_state_dict(engine.module),
            "scale": engine.loss_scale,
        }
        del engine, params
    return out


def test_safe_get_under_bf16_and_fp16_gives_fp32_masters_and_unscaled_gradients():
    results = run_ranks(_mixed_precision_values, 2, timeout=120)
    x, y = global_batches(2, 4)[1]
    for name in ("bf16-0", "bf16-2", "fp16-3"):
        r = results[0][name]
        assert torch.equal(r["master"]["norm.weight"], results[1][name]["master"]["norm.weight"])
        low = next(iter(r["weights"].values())).dtype
        assert low == (torch.float16 if name.startswith("fp16") else torch.bfloat16), name
        moved = 0
        for n, w in r["weights"].items():
            m = r["master"][n]
            assert m.dtype == torch.float32 and torch.equal(m.to(low), w), (name, n)  # the weights are the masters
            moved += int((m != w.float()).sum())
        assert moved > 0, name  # the masters keep what the low-precision weights cannot
        # the gradient the optimizer will see: that of the loss at these weights, not times the loss scale
        model = make_model()
        model.load_state_dict({n: w.float() for n, w in r["weights"].items()})
        model(x, y).backward()
        got = torch.cat([r["grad"][n].reshape(-1) for n, _ in model.named_parameters()])
        want = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
        assert float((got - want).norm() / want.norm()) < 0.05, name
        assert r["scale"] == (2.0**12 if name.startswith("fp16") else 1.0)


def _offloaded_gradient_and_weight_edits():
    from zerotron.zero import consolidated_state_dict

    batches = global_batches(2, 4)
    out = {}
    for stage in (2, 3):
        zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 100}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization=zero))
        for i, batch in enumerate(batches):
            ((x, y),) = micro_batches(batch, engine.coords.dp, 2, 1)
            engine.backward(engine(x, y))
            if i == 0:
                engine.step()
        p = dict(engine.module.named_parameters())["layers.0.attn.wq.weight"]
        momentum = utils.safe_get_full_optimizer_state(p, "exp_avg").clone()
        # the gradient has already left for the host: the edit must reach the host-side step too
        utils.safe_set_full_grad(p, torch.zeros(64, 64))
        engine.step()
        r = {
            "momentum_decayed": torch.allclose(
                utils.safe_get_full_optimizer_state(p, "exp_avg"), 0.9 * momentum, rtol=1e-6, atol=0
            )
        }
        new = torch.full((64, 64), 0.01)
        utils.safe_set_full_fp32_param(p, new)
        r["weights_set"] = torch.equal(consolidated_state_dict(engine.module)["layers.0.attn.wq.weight"], new)
        out[stage] = r
        del engine, p
    return out


def test_safe_set_under_offload_reaches_the_host_step_and_the_weights():
    for r in run_ranks(_offloaded_gradient_and_weight_edits, 2, timeout=120):
        assert r == {
            2: {"momentum_decayed": True, "weights_set": True},
            3: {"momentum_decayed": True, "weights_set": True},
        }


def test_safe_functions_return_none_outside_an_engine():
    p = torch.nn.Parameter(torch.ones(3))
    assert utils.safe_get_full_fp32_param(p) is None and utils.safe_get_full_grad(p) is None
    assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None and utils.safe_get_local_fp32_param(p) is None


# ---- zero_to_fp32 on a ZeRO-2 checkpoint saved by two ranks ---------------------------------------------
def _train_and_save(save_dir):
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization={"stage": 2}))
    for batch in global_batches(2, 4):
        ((x, y),) = micro_batches(batch, engine.coords.dp, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(save_dir)
    return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def _same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_zero_to_fp32_gives_the_models_state_dict(tmp_path):
    state, _ = run_ranks(_train_and_save, 2, str(tmp_path / "ckpt"))
    ckpt = tmp_path / "ckpt"
    _same(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt), state)
    _same(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="global_step2"), state)
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    assert lazy["norm.weight"].shape == state["norm.weight"].shape
    _same({k: v.contiguous() for k, v in lazy.items()}, state)

    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "bin")
    _same(torch.load(tmp_path / "bin" / "pytorch_model.bin"), state)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "st", safe_serialization=True)
    from safetensors.torch import load_file

    _same(load_file(str(tmp_path / "st" / "model.safetensors")), state)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "shards", max_shard_size="100KB")
    index = json.loads((tmp_path / "shards" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
    merged = {}
    for f in files:
        merged.update(torch.load(tmp_path / "shards" / f))
    _same(merged, state)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "old" / "weights.bin")  # older API: a file
    _same(torch.load(tmp_path / "old" / "weights.bin"), state)
    zero_to_fp32.main([str(ckpt), str(tmp_path / "cli"), "--safe_serialization", "-t", "global_step2"])
    _same(load_file(str(tmp_path / "cli" / "model.safetensors")), state)

    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(make_model(seed=5), ckpt)
    _same(model.state_dict(), state)
    with pytest.raises(ValueError, match="latest"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="global_step9"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step9")
