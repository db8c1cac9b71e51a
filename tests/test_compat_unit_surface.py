"""Calls DeepSpeed's own unit tests make, made the way they make them (tools/deepspeed_unit_tests.py found each
one failing through the alias): the LRRangeTest scheduler from the config, engine.no_sync()'s refusals as
AssertionErrors, checkpoint.tag_validation, tied weights through zero_to_fp32, runtime.utils' clip_grad_norm_ and
partition helpers, and the module paths those tests import first (op_builder, git_version_info, utils.torch,
runtime.zero.config)."""

import math
import warnings

import pytest
import torch
import torch.nn as nn
from distributed import RankError, run_ranks

import zerotron
from zerotron.compat.runtime import utils as ds_utils


class _Tiny(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        if tie:
            self.b.weight = self.c.weight

    def forward(self, x):
        return self.c(self.b(self.a(x))).pow(2).mean()


def _config(stage=0, **extra):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        **extra,
    }


# ---- LRRangeTest, from the config's scheduler section -----------------------------------------------------
def _range_test_lrs(staircase):
    torch.manual_seed(0)
    params = {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}
    params["lr_range_test_staircase"] = staircase
    cfg = _config(scheduler={"type": "LRRangeTest", "params": params})
    engine, _, _, sched = zerotron.initialize(model=_Tiny(), config=cfg)
    lrs = []
    for _ in range(7):
        lrs.append(sched.get_lr()[0])
        engine.backward(engine(torch.randn(1, 8)))
        engine.step()
    return lrs, type(sched).__name__


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_from_the_config(staircase):
    (lrs, name), *_ = run_ranks(_range_test_lrs, 1, staircase)
    assert name == "LRRangeTest"
    t = [(k / 3) if not staircase else math.floor(k / 3) for k in range(7)]  # get_lr() before step k
    assert lrs == pytest.approx([1e-3 * (1 + 2.0 * x) for x in t], rel=1e-12)
    assert lrs[0] == 1e-3  # DeepSpeed's test: the first lr is the min lr


def test_lr_range_test_parameters_are_checked():
    with pytest.raises(zerotron.ConfigError, match="lr_range_test_step_size"):
        zerotron.Config.load(
            {"train_batch_size": 1, "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}}
        )


# ---- no_sync: what DeepSpeed refuses, refused as an AssertionError ------------------------------------------
def _no_sync_refusals(stage):
    engine, *_ = zerotron.initialize(model=_Tiny(), config=_config(stage))
    assert engine.sparse_tensor_module_names == set()  # (DeepSpeed's checkpoint tests compare it; all reduced dense)
    out = {}
    try:
        with engine.no_sync():
            engine.backward(engine(torch.randn(1, 8)))
            try:
                engine.step()
            except AssertionError as e:
                out["step"] = str(e)
            try:
                with engine.no_sync():
                    pass
            except AssertionError as e:
                out["nested"] = str(e)
    except AssertionError as e:
        out["enter"] = str(e)
    return out


def test_no_sync_refusals_are_assertion_errors_as_in_deepspeed():
    for stage, out in [(1, run_ranks(_no_sync_refusals, 1, 1)[0]), (3, run_ranks(_no_sync_refusals, 1, 3)[0])]:
        if stage == 1:
            assert "illegal to call Engine.step() inside no_sync context manager" in out["step"]
            assert "no_sync context manager reentry is unsupported" in out["nested"]
        else:
            assert set(out) == {"enter"} and "no_sync context manager is incompatible with ZeRO stage 3" in out["enter"]


# ---- checkpoint.tag_validation ------------------------------------------------------------------------------
def _save_with_rank_tags(mode, save_dir):
    import torch.distributed as dist

    engine, *_ = zerotron.initialize(model=_Tiny(), config=_config(1, checkpoint={"tag_validation": mode}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine.save_checkpoint(save_dir, tag=f"tag-{dist.get_rank()}")
            outcome = "saved"
        except AssertionError as e:
            outcome = f"refused: {e}"
    return outcome, [str(w.message) for w in caught if "tags differ" in str(w.message)]


@pytest.mark.parametrize("mode", ["Fail", "Warn", "Ignore"])
def test_checkpoint_tag_validation(mode, tmp_path):
    results = run_ranks(_save_with_rank_tags, 2, mode, str(tmp_path))
    if mode == "Fail":
        assert all(o.startswith("refused") and "tags differ across ranks" in o for o, _ in results)
        assert not list(tmp_path.iterdir())
        return
    assert [o for o, _ in results] == ["saved", "saved"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "tag-0"]  # one checkpoint, rank 0's tag
    assert all(bool(w) == (mode == "Warn") for _, w in results)


def test_checkpoint_tag_validation_value_is_checked():
    with pytest.raises(zerotron.ConfigError, match="checkpoint.tag_validation"):
        zerotron.Config.load({"train_batch_size": 1, "checkpoint": {"tag_validation": "foo"}})


def _save_empty_dir():
    engine, *_ = zerotron.initialize(model=_Tiny(), config=_config())
    engine.save_checkpoint("")


def test_save_checkpoint_refuses_an_empty_directory():
    with pytest.raises(RankError, match="save_dir"):
        run_ranks(_save_empty_dir, 1)


# ---- engine.empty_partition_cache ----------------------------------------------------------------------------
def _losses_with_cache_emptied(stage: int, empty: bool):
    torch.manual_seed(0)
    engine, *_ = zerotron.initialize(model=_Tiny(), config=_config(stage))
    losses, sizes = [], []
    for step in range(3):
        torch.manual_seed(step)
        loss = engine(torch.randn(1, 8))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if empty:  # (DeepSpeed's checkpoint tests call it between training and saving)
            engine.empty_partition_cache()
            sizes.append(engine.module.a.weight.numel())
    return losses, sizes


@pytest.mark.parametrize("stage", [1, 3])
def test_empty_partition_cache_leaves_training_as_it_was(stage):
    (kept, _), *_ = run_ranks(_losses_with_cache_emptied, 1, stage, False)
    (emptied, sizes), *_ = run_ranks(_losses_with_cache_emptied, 1, stage, True)
    assert emptied == kept
    # 64-element weights are below stage3_param_persistence_threshold: ZeRO-3 keeps them whole, the call too
    assert sizes == [64, 64, 64]


# ---- tied weights through zero_to_fp32 ----------------------------------------------------------------------
def _save_tied(save_dir):
    torch.manual_seed(0)
    model = _Tiny(tie=True)
    engine, *_ = zerotron.initialize(model=model, config=_config(2))
    engine.save_checkpoint(save_dir, tag="t")


def test_tied_weights_load_strictly_from_zero_to_fp32(tmp_path):
    from zerotron.compat.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    run_ranks(_save_tied, 2, str(tmp_path / "ckpt"))
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t")
    model = _Tiny(tie=True)
    model.load_state_dict(state, strict=True)  # b.weight and c.weight: both names present
    assert state["b.weight"] is state["c.weight"]  # one tensor, as in DeepSpeed's state dict
    torch.manual_seed(0)
    assert torch.equal(model.c.weight, _Tiny(tie=True).c.weight)
    convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "fp32"), tag="t")
    saved = torch.load(tmp_path / "fp32" / "pytorch_model.bin")
    assert saved["b.weight"] is saved["c.weight"]  # torch.save kept the tie
    _Tiny(tie=True).load_state_dict(saved, strict=True)


# ---- errors cross process boundaries ------------------------------------------------------------------------
def _refused_config(_):
    zerotron.Config.load({"train_batch_size": 1, "gradient_allreduce_op": "sum"})


def test_config_error_comes_back_from_a_pool_worker():
    """DeepSpeed's test harness runs each rank in a multiprocessing pool: a ConfigError that could not be unpickled
    (its three-argument __init__) killed the pool's result thread and the test waited forever."""
    import multiprocessing as mp
    import pickle

    error = pickle.loads(pickle.dumps(zerotron.ConfigError("k", 1, "use 2")))
    assert (error.key, error.value, error.fix, str(error)) == ("k", 1, "use 2", "config key 'k' = 1: use 2")
    with mp.get_context("spawn").Pool(1) as pool:
        with pytest.raises(zerotron.ConfigError, match="gradient_allreduce_op"):
            pool.map_async(_refused_config, [0]).get(timeout=60)


# ---- runtime.utils: clip_grad_norm_ and the partition helpers -------------------------------------------------
def _clip(max_norm):
    import torch.distributed as dist

    rank = dist.get_rank()
    shared, expert = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    shared.grad, expert.grad = torch.tensor([1.0]), torch.tensor([rank + 1.0])  # experts differ by rank
    norm = ds_utils.clip_grad_norm_([shared, expert], max_norm=max_norm)
    return float(norm), float(shared.grad), float(expert.grad)


def test_clip_grad_norm_averages_the_norm_over_data_parallel_ranks():
    results = run_ranks(_clip, 2, 0.1)
    mean = (math.sqrt(2.0) + math.sqrt(5.0)) / 2  # each rank's norm, averaged: every rank clips alike
    coef = 0.1 / (mean + 1e-6)
    for rank, (norm, shared, expert) in enumerate(results):
        assert norm == pytest.approx(mean, rel=1e-6)
        assert shared == pytest.approx(coef, rel=1e-6) and expert == pytest.approx((rank + 1) * coef, rel=1e-6)


def test_clip_grad_norm_matches_torch_on_one_process():
    ours, theirs = [nn.Parameter(torch.zeros(3)) for _ in range(2)], [nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for a, b, g in zip(ours, theirs, (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.0, -4.0]))):
        a.grad, b.grad = g.clone(), g.clone()
    assert float(ds_utils.clip_grad_norm_(ours, 0.5)) == pytest.approx(float(nn.utils.clip_grad_norm_(theirs, 0.5)))
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(ours, theirs))


def test_partition_helpers():
    assert ds_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert ds_utils.partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # fewer items than parts: empty parts last
    assert ds_utils.partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert ds_utils.partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert ds_utils.partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    for weights, parts, spread in [([1, 2, 1], 4, 2), ([1, 1, 1, 1, 1], 4, 1), ([1, 1, 1, 1, 0, 1], 4, 1)]:
        b = ds_utils.partition_balanced(weights, parts)
        sums = [sum(weights[lo:hi]) for lo, hi in zip(b, b[1:])]
        assert len(b) == parts + 1 and max(sums) - min(sums) == spread


# ---- module paths DeepSpeed's tests import first --------------------------------------------------------------
def test_installation_and_op_names():
    from zerotron.compat import git_version_info, op_builder
    from zerotron.compat.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from zerotron.compat.utils.torch_version import required_torch_version

    assert git_version_info.version == zerotron.__version__
    assert git_version_info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert set(git_version_info.installed_ops.values()) == {False}  # nothing compiled
    assert zerotron.ops.__compatible_ops__[op_builder.FusedAdamBuilder.NAME]
    assert not zerotron.ops.__compatible_ops__[op_builder.AsyncIOBuilder.NAME]
    assert op_builder.QuantizerBuilder.NAME == "deepspeed_not_implemented"  # DeepSpeed's CPU answer
    with pytest.raises(RuntimeError, match="zerotron.ops.adam.DeepSpeedCPUAdam"):
        op_builder.CPUAdamBuilder().load()
    assert required_torch_version(min_version="1.8") and not required_torch_version(max_version="1.8")
    zero = DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=12345)
    assert (zero.stage, zero.prefetch_bucket_size, ZeroStageEnum(3).name) == (3, 12345, "weights")
    with pytest.raises(zerotron.ConfigError, match="zero_optimization.stage"):
        DeepSpeedZeroConfig(stage=4)
