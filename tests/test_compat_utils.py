"""The `deepspeed.utils` and `deepspeed.moe.utils` surface (zerotron/compat): loaders, logging, seeds,
OnDevice, leaf modules, MoE parameter groups, the groups answered from the latest engine's topology and
zero_to_fp32; what scripts import from them does what it does under DeepSpeed, on zerotron's engines.
safe_get/set_full_* are tests/test_compat_safe_get.py's."""

import json
import logging
import random

import numpy
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from parity import ds_config, global_batches, make_model, micro_batches

import zerotron
from zerotron.compat import moe, runtime, utils
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
        # zerotron's defaults (rank 0 INFO; the others WARNING: its own messages once), whatever an earlier
        # engine in this worker process set from a config's log_level
        utils.logger.setLevel(logging.WARNING if dist.get_rank() == 1 else logging.INFO)
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
    split = moe.layer.MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=2)
    with pytest.raises(RuntimeError, match="ep_size 2 but no expert-parallel group: pass the model to zerotron.init"):
        split(torch.zeros(3, 8))
    assert moe.utils.has_moe_layers(make_model()) == (False, 0)
    layer = moe.layer.MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4)
    assert moe.utils.has_moe_layers(torch.nn.Sequential(layer)) == (True, 4)
    shared, experts = moe.utils.split_params_into_shared_and_expert_params(list(layer.parameters()))
    assert len(experts) == 8 and shared == [layer.deepspeed_moe.gate.wg.weight]


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


def test_deepspeed_chats_module_helpers_and_epoch_count():
    """DeepSpeed-Chat's LoRA code imports recursive_getattr/recursive_setattr from
    deepspeed.compression.helper (DeepSpeed keeps them there and in utils.module_utils); its training
    loop calls engine.tput_timer.update_epoch_count() at each epoch."""
    import importlib

    from zerotron.engine.accessors import ThroughputTimer

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    for path in ("zerotron.compat.utils.module_utils",):
        helper = importlib.import_module(path)
        assert helper.recursive_getattr(model, "0.0") is model[0][0]
        replacement = torch.nn.Linear(2, 3)
        helper.recursive_setattr(model, "0.0", replacement)
        assert model[0][0] is replacement
        helper.recursive_setattr(model, "1", torch.nn.Tanh())
        assert isinstance(model[1], torch.nn.Tanh)
    timer = ThroughputTimer(batch_size=4)
    timer.stop(global_step=False)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)
