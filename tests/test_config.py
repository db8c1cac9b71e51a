"""Config loading: the batch triple, type/value validation, unknown keys, "auto" and config sources.

Pure Python: no process groups. Every error case checks that the message names the key.
"""

import json
import math
import pathlib
import warnings

import pytest
import torch

from zerotron.config import Config, read_raw, resolve_auto
from zerotron.errors import ConfigError
from zerotron.optim import build_optimizer, validate_optimizer


def load(extra=None, *, world_size=1, **auto):
    raw = {"train_batch_size": 8}
    raw.update(extra or {})
    return Config.load(raw, world_size=world_size, **auto)


def triple(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


def zerotron_warnings(record):
    return [str(w.message) for w in record if "zerotron" in str(w.message)]


# =============================================================================== batch triple
TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"

# (world size, given keys, expected (train_batch_size, micro, accumulation)), written out by hand.
BATCH_OK = [
    # all three, consistent
    (1, {TBS: 16, MBS: 2, GAS: 8}, (16, 2, 8)),
    (2, {TBS: 16, MBS: 2, GAS: 4}, (16, 2, 4)),
    (4, {TBS: 16, MBS: 2, GAS: 2}, (16, 2, 2)),
    # train_batch_size + micro: accumulation derived
    (1, {TBS: 16, MBS: 2}, (16, 2, 8)),
    (2, {TBS: 16, MBS: 2}, (16, 2, 4)),
    (4, {TBS: 16, MBS: 2}, (16, 2, 2)),
    (4, {TBS: 8, MBS: 2}, (8, 2, 1)),
    # train_batch_size + accumulation: micro derived
    (1, {TBS: 16, GAS: 2}, (16, 8, 2)),
    (2, {TBS: 16, GAS: 2}, (16, 4, 2)),
    (4, {TBS: 16, GAS: 2}, (16, 2, 2)),
    # micro + accumulation: train_batch_size derived
    (1, {MBS: 3, GAS: 2}, (6, 3, 2)),
    (2, {MBS: 3, GAS: 2}, (12, 3, 2)),
    (4, {MBS: 3, GAS: 2}, (24, 3, 2)),
    # only train_batch_size: accumulation 1
    (1, {TBS: 8}, (8, 8, 1)),
    (2, {TBS: 8}, (8, 4, 1)),
    (4, {TBS: 8}, (8, 2, 1)),
    # only micro: accumulation 1
    (1, {MBS: 5}, (5, 5, 1)),
    (2, {MBS: 5}, (10, 5, 1)),
    (4, {MBS: 5}, (20, 5, 1)),
    # floats that are integers are accepted for int keys
    (2, {TBS: 16.0, MBS: 2.0}, (16, 2, 4)),
]


@pytest.mark.parametrize("world_size,given,expected", BATCH_OK)
def test_batch_triple_resolves(world_size, given, expected):
    cfg = Config.load(given, world_size=world_size)
    assert triple(cfg) == expected
    assert all(type(v) is int for v in triple(cfg))
    assert cfg.dp_size == world_size
    # the invariant DeepSpeed asserts
    tbs, mbs, gas = triple(cfg)
    assert tbs == mbs * gas * world_size


# (world size, given keys, the key the error names, the value, words of the fix)
BATCH_BAD = [
    # all three, inconsistent
    (1, {TBS: 16, MBS: 2, GAS: 4}, TBS, 16, ["= 8", "leave one out"]),
    (2, {TBS: 16, MBS: 2, GAS: 8}, TBS, 16, ["= 32", "leave one out"]),
    (4, {TBS: 16, MBS: 2, GAS: 4}, TBS, 16, ["= 32", "leave one out"]),
    # train_batch_size + micro, not divisible by micro x data-parallel size
    (1, {TBS: 6, MBS: 4}, TBS, 6, ["divisible by", MBS, "(4)", "data-parallel size (1)"]),
    (2, {TBS: 6, MBS: 2}, TBS, 6, ["divisible by", MBS, "(2)", "data-parallel size (2)"]),
    (4, {TBS: 12, MBS: 2}, TBS, 12, ["divisible by", MBS, "(2)", "data-parallel size (4)"]),
    # train_batch_size + accumulation, not divisible by accumulation x data-parallel size
    (1, {TBS: 6, GAS: 4}, TBS, 6, ["divisible by", GAS, "(4)", "data-parallel size (1)"]),
    (2, {TBS: 12, GAS: 4}, TBS, 12, ["divisible by", GAS, "(4)", "data-parallel size (2)"]),
    (4, {TBS: 8, GAS: 4}, TBS, 8, ["divisible by", GAS, "(4)", "data-parallel size (4)"]),
    # only train_batch_size, not divisible by the data-parallel size
    (2, {TBS: 3}, TBS, 3, ["divisible by", "data-parallel size (2)"]),
    (4, {TBS: 6}, TBS, 6, ["divisible by", "data-parallel size (4)"]),
    # neither train_batch_size nor micro
    (1, {}, MBS, None, ["set train_micro_batch_size_per_gpu or train_batch_size"]),
    (2, {GAS: 4}, MBS, None, ["set train_micro_batch_size_per_gpu or train_batch_size"]),
    (4, {}, MBS, None, ["set train_micro_batch_size_per_gpu or train_batch_size"]),
    # zero / negative
    (1, {TBS: 0}, TBS, 0, ["positive integer"]),
    (2, {TBS: -8}, TBS, -8, ["positive integer"]),
    (1, {MBS: 0}, MBS, 0, ["positive integer"]),
    (4, {MBS: -1, GAS: 2}, MBS, -1, ["positive integer"]),
    (1, {TBS: 8, GAS: 0}, GAS, 0, ["positive integer"]),
    (2, {MBS: 2, GAS: -3}, GAS, -3, ["positive integer"]),
]


@pytest.mark.parametrize("world_size,given,key,value,fix_words", BATCH_BAD)
def test_batch_triple_errors(world_size, given, key, value, fix_words):
    with pytest.raises(ConfigError) as info:
        Config.load(given, world_size=world_size)
    err = info.value
    assert err.key == key
    assert err.value == value
    message = str(err)
    assert f"'{key}'" in message and repr(value) in message
    for words in fix_words:
        assert words in message


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batch_error_is_raised_before_anything_else_is_touched(world_size):
    # The given dict is not modified by a failing load.
    given = {TBS: 7, MBS: 2}
    with pytest.raises(ConfigError):
        Config.load(given, world_size=world_size)
    assert given == {TBS: 7, MBS: 2}


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_must_be_positive(world_size):
    with pytest.raises(ConfigError, match="world_size"):
        Config.load({TBS: 8}, world_size=world_size)


# ---------------------------------------------------------------- tensor parallel
def test_tensor_parallel_one_is_plain_data_parallel():
    cfg = Config.load({TBS: 16, "tensor_parallel": {"autotp_size": 1}}, world_size=4)
    assert cfg.dp_size == 4
    assert triple(cfg) == (16, 4, 1)


@pytest.mark.parametrize("world_size,tp,dp", [(2, 2, 1), (4, 2, 2), (4, 4, 1), (8, 2, 4)])
def test_tensor_parallel_divides_the_world(world_size, tp, dp):
    cfg = Config.load({TBS: 16, "tensor_parallel": {"autotp_size": tp}}, world_size=world_size)
    assert cfg.dp_size == dp and cfg.train_micro_batch_size_per_gpu == 16 // dp


@pytest.mark.parametrize("world_size,tp", [(4, 3), (2, 4), (1, 2)])
def test_tensor_parallel_that_does_not_divide_the_world(world_size, tp):
    with pytest.raises(ConfigError) as info:
        Config.load({TBS: 16, "tensor_parallel": {"autotp_size": tp}}, world_size=world_size)
    assert info.value.key == "tensor_parallel.autotp_size"
    assert "must divide the number of processes" in str(info.value)


@pytest.mark.parametrize(
    "tp,pp,key", [(1, 3, "pipeline.stages"), (3, 1, "tensor_parallel.autotp_size"), (2, 3, "pipeline.stages")]
)
def test_the_layout_error_names_the_key_the_user_set(tp, pp, key):
    with pytest.raises(ConfigError) as info:
        Config.load({TBS: 16, "pipeline": {"stages": pp}, "tensor_parallel": {"autotp_size": tp}}, world_size=2)
    assert info.value.key == key
    assert ("tensor (2) x pipeline (3)" in str(info.value)) == (tp > 1 and pp > 1)


@pytest.mark.parametrize("tp", [0, -2])
def test_tensor_parallel_must_be_positive(tp):
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size.*positive integer"):
        Config.load({TBS: 16, "tensor_parallel": {"autotp_size": tp}}, world_size=2)


def test_tensor_parallel_wrong_type():
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size.*expected an integer"):
        Config.load({TBS: 16, "tensor_parallel": {"autotp_size": "2"}}, world_size=2)


# =============================================================================== types and values
# (extra config keys on top of {"train_batch_size": 8}, the key the error names, words of the fix)
BAD = [
    # strings for ints
    ({TBS: "8"}, TBS, "expected an integer"),
    ({MBS: "2"}, MBS, "expected an integer"),
    ({GAS: "1"}, GAS, "expected an integer"),
    ({"steps_per_print": "10"}, "steps_per_print", "expected an integer"),
    ({"fp16": {"enabled": True, "loss_scale_window": "1000"}}, "fp16.loss_scale_window", "expected an integer"),
    ({"zero_optimization": {"stage": "0"}}, "zero_optimization.stage", "expected an integer"),
    (
        {"zero_optimization": {"reduce_bucket_size": "5e8"}},
        "zero_optimization.reduce_bucket_size",
        "expected an integer",
    ),
    # floats that are not integers for int keys
    ({TBS: 8.5}, TBS, "expected an integer"),
    ({GAS: 1.5}, GAS, "expected an integer"),
    ({"fp16": {"initial_scale_power": 15.5}}, "fp16.initial_scale_power", "expected an integer"),
    (
        {"zero_optimization": {"allgather_bucket_size": 2.5e8 + 0.5}},
        "zero_optimization.allgather_bucket_size",
        "expected an integer",
    ),
    ({TBS: math.inf}, TBS, "expected an integer"),
    ({TBS: math.nan}, TBS, "expected an integer"),
    # booleans are not ints or numbers; ints are not booleans
    ({TBS: True}, TBS, "expected an integer"),
    ({"gradient_clipping": True}, "gradient_clipping", "expected a finite number"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled", "expected true or false"),
    ({"bf16": {"enabled": 1}}, "bf16.enabled", "expected true or false"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "expected a finite number"),
    ({"communication_data_type": 16}, "communication_data_type", "expected a string"),
    ({"fp16": [True]}, "fp16", "expected a JSON object"),
    ({"optimizer": {"type": "AdamW", "params": [1e-3]}}, "optimizer.params", "expected a JSON object"),
    # zero and negative values
    ({"steps_per_print": 0}, "steps_per_print", "positive integer"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale", "0 for dynamic"),
    ({"fp16": {"enabled": True, "initial_scale_power": -1}}, "fp16.initial_scale_power", "[0, 64]"),
    ({"fp16": {"enabled": True, "initial_scale_power": 65}}, "fp16.initial_scale_power", "[0, 64]"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window", "positive number"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis", "positive integer"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale", "positive scale"),
    ({"fp16": {"enabled": True, "min_loss_scale": -1.0}}, "fp16.min_loss_scale", "positive scale"),
    # fp16 and bf16 together
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "enable at most one"),
    # ZeRO
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "use 0 (data parallel), 1, 2 or 3"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage", "use 0 (data parallel), 1, 2 or 3"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", "positive"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, "zero_optimization.reduce_bucket_size", "positive"),
    ({"zero_optimization": {"allgather_bucket_size": 0}}, "zero_optimization.allgather_bucket_size", "positive"),
    ({"zero_optimization": {"sub_group_size": -1}}, "zero_optimization.sub_group_size", "positive"),
    (
        {"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
        "zero_optimization.stage3_prefetch_bucket_size",
        "0: no prefetching",
    ),
    (
        {"zero_optimization": {"stage3_max_live_parameters": 0}},
        "zero_optimization.stage3_max_live_parameters",
        "positive",
    ),
    (
        {"zero_optimization": {"stage3_param_persistence_threshold": -1}},
        "zero_optimization.stage3_param_persistence_threshold",
        "non-negative",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "tape"}}},
        "zero_optimization.offload_optimizer.device",
        "use 'none', 'cpu' or 'nvme'",
    ),
    (
        {"zero_optimization": {"offload_param": {"device": "tape"}}},
        "zero_optimization.offload_param.device",
        "use 'none', 'cpu' or 'nvme'",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer.device",
        "needs zero_optimization.stage 1, 2 or 3",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
        "zero_optimization.offload_param.device",
        "NVMe offload (ZeRO-Infinity) is not supported",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": 1}}},
        "zero_optimization.offload_optimizer.device",
        "expected a string",
    ),
    # clipping and communication
    ({"gradient_clipping": -1.0}, "gradient_clipping", "0 to disable"),
    ({"gradient_clipping": math.nan}, "gradient_clipping", "expected a finite number"),
    ({"communication_data_type": "int8"}, "communication_data_type", "'fp32', 'fp16' or 'bf16'"),
    ({"communication_data_type": "float32"}, "communication_data_type", "'fp32', 'fp16' or 'bf16'"),
    # optimizer
    ({"optimizer": {"type": "Shampoo", "params": {}}}, "optimizer.type", "a torch.optim optimizer's name"),
    (
        {"optimizer": {"type": "Lamb", "params": {}}, "zero_optimization": {"stage": 2}},
        "optimizer.type",
        "use zero_optimization.stage 0",
    ),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type", "your own torch optimizer"),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}},
        "optimizer.params.momentum",
        "unknown parameter",
    ),
    (
        {"optimizer": {"type": "SGD", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}}},
        "optimizer.params.betas",
        "unknown parameter",
    ),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "foo": 1}}}, "optimizer.params.foo", "unknown parameter"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", "two numbers in [0, 1)"),
    (
        {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
        "optimizer.params.betas",
        "two numbers in [0, 1)",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"betas": [-0.1, 0.999]}}},
        "optimizer.params.betas",
        "two numbers in [0, 1)",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"betas": "0.9,0.999"}}},
        "optimizer.params.betas",
        "two numbers in [0, 1)",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999, 0.9]}}},
        "optimizer.params.betas",
        "two numbers in [0, 1)",
    ),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, "optimizer.params.lr", "non-negative"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "optimizer.params.lr", "non-negative"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}, "optimizer.params.eps", "non-negative"),
    (
        {"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}},
        "optimizer.params.weight_decay",
        "non-negative",
    ),
    ({"optimizer": {"type": "SGD", "params": {"momentum": -0.9}}}, "optimizer.params.momentum", "non-negative"),
    (
        {"optimizer": {"type": "Adam", "params": {"bias_correction": False, "torch_adam": True}}},
        "optimizer.params.bias_correction",
        "torch's Adam (torch_adam: true) always applies bias correction",
    ),
    # scheduler
    ({"scheduler": {"type": "CosineAnnealing", "params": {}}}, "scheduler.type", "WarmupLR"),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}},
        "scheduler.params.warmup_num_steps",
        "integer >= 0",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}},
        "scheduler.params.total_num_steps",
        "WarmupLR takes only",
    ),
    (
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
        "scheduler.params.total_num_steps",
        "WarmupDecayLR needs total_num_steps",
    ),
    (
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 5}}},
        "scheduler.params.total_num_steps",
        ">= warmup_num_steps (10)",
    ),
    # monitors
    ({"wandb": {"enabled": True}}, "wandb.enabled", "tensorboard"),
    # "auto" on a key zerotron cannot resolve
    ({"steps_per_print": "auto"}, "steps_per_print", "cannot resolve 'auto'"),
    (
        {"activation_checkpointing": {"partition_activations": "auto"}},
        "activation_checkpointing.partition_activations",
        "cannot resolve 'auto'",
    ),
]


@pytest.mark.parametrize("extra,key,fix", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_values_raise_config_error_naming_the_key(extra, key, fix):
    with pytest.raises(ConfigError) as info:
        load(extra)
    message = str(info.value)
    assert info.value.key == key
    assert f"config key '{key}'" in message
    assert fix in message
    assert isinstance(info.value, ValueError)


def test_fp16_and_bf16_message_names_both():
    with pytest.raises(ConfigError) as info:
        load({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16" in str(info.value) and "bf16" in str(info.value)


def test_integer_valued_floats_are_accepted_for_int_keys():
    cfg = load(
        {
            "zero_optimization": {
                "reduce_bucket_size": 5e8,
                "allgather_bucket_size": 2e8,
                "stage3_param_persistence_threshold": 1e4,
            },
            "steps_per_print": 1e2,
        }
    )
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.stage3_param_persistence_threshold) == (
        500_000_000,
        200_000_000,
        10_000,
    )
    assert all(type(v) is int for v in (z.reduce_bucket_size, z.allgather_bucket_size, cfg.steps_per_print))
    assert cfg.steps_per_print == 100


def test_ints_are_accepted_for_float_keys_and_converted():
    cfg = load({"gradient_clipping": 1, "fp16": {"enabled": True, "min_loss_scale": 2}})
    assert cfg.gradient_clipping == 1.0 and type(cfg.gradient_clipping) is float
    assert cfg.fp16.min_loss_scale == 2.0 and type(cfg.fp16.min_loss_scale) is float


def test_valid_values_are_accepted():
    cfg = load(
        {
            "gradient_clipping": 0.0,
            "communication_data_type": "bf16",
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}},
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01, "adam_w_mode": False},
            },
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
            "wandb": {"enabled": False},
            "tensorboard": {"enabled": True, "output_path": "/tmp/tb", "job_name": "x"},
        }
    )
    assert cfg.model_dtype_name == "bf16"
    assert cfg.communication_data_type == "bf16"
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params["lr"] == 3e-4
    assert cfg.scheduler.params == {"warmup_num_steps": 10, "total_num_steps": 100}
    assert cfg.tensorboard.enabled and cfg.tensorboard.output_path == "/tmp/tb"
    assert cfg.zero_optimization.offload_optimizer.device == "none"


def test_defaults_are_deepspeeds():
    cfg = load()
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False and cfg.model_dtype_name == "fp32"
    assert (
        cfg.fp16.loss_scale,
        cfg.fp16.initial_scale_power,
        cfg.fp16.loss_scale_window,
        cfg.fp16.hysteresis,
        cfg.fp16.consecutive_hysteresis,
        cfg.fp16.min_loss_scale,
    ) == (0.0, 16, 1000, 2, False, 1.0)
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size is None  # unset: the engine cuts ~8 buckets (zero/flat.py)
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.model_dtype_name == "fp32"
    assert load({"fp16": {"enabled": True}}).model_dtype_name == "fp16"


# ---------------------------------------------------------------- optimizer names and DeepSpeed's Adam
@pytest.mark.parametrize("type_name", ["Adam", "adam", "ADAMW", "AdamW", "SGD", "sgd"])
def test_optimizer_type_is_case_insensitive(type_name):
    validate_optimizer(type_name, {"lr": 0.1})


def _param():
    return [torch.nn.Parameter(torch.zeros(3))]


def test_deepspeed_adam_is_adamw_unless_adam_w_mode_false():
    assert type(build_optimizer("Adam", {"lr": 1e-3}, _param())) is torch.optim.AdamW
    assert type(build_optimizer("Adam", {"lr": 1e-3, "adam_w_mode": True}, _param())) is torch.optim.AdamW
    assert type(build_optimizer("Adam", {"lr": 1e-3, "adam_w_mode": False}, _param())) is torch.optim.Adam
    assert type(build_optimizer("AdamW", {"lr": 1e-3, "adam_w_mode": False}, _param())) is torch.optim.AdamW
    assert type(build_optimizer("SGD", {"lr": 1e-3, "momentum": 0.9}, _param())) is torch.optim.SGD
    opt = build_optimizer(
        "Adam",
        {
            "lr": 2e-3,
            "betas": [0.8, 0.9],
            "eps": 1e-6,
            "weight_decay": 0.1,
            "bias_correction": True,
            "torch_adam": True,
        },
        _param(),
    )
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-3, (0.8, 0.9), 1e-6, 0.1)


def test_build_optimizer_validates():
    with pytest.raises(ConfigError, match="optimizer.params.max_grad_norm.*gradient_clipping"):
        build_optimizer("AdamW", {"max_grad_norm": 1.0}, _param())


# =============================================================================== config sources
def test_missing_config_path(tmp_path):
    path = str(tmp_path / "nope" / "ds_config.json")
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    message = str(info.value)
    assert info.value.key == "config" and "config key 'config'" in message
    assert path in message and "no such file" in message


def test_invalid_json_file_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,, }')
    with pytest.raises(ConfigError) as info:
        Config.load(str(path))
    message = str(info.value)
    assert "config key 'config'" in message
    assert str(path) in message and "not valid JSON" in message and "line 1" in message


def test_invalid_inline_json():
    with pytest.raises(ConfigError, match="config.*<inline JSON>.*not valid JSON"):
        Config.load('{"train_batch_size": }')


@pytest.mark.parametrize("text", ["[1, 2]", '"train_batch_size"', "8", "null"])
def test_non_object_json_file(tmp_path, text):
    path = tmp_path / "list.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    message = str(info.value)
    assert "config key 'config'" in message and str(path) in message
    assert "object at the top level" in message


@pytest.mark.parametrize("source", [42, None, ["train_batch_size", 8], b"{}"])
def test_wrong_source_type(source):
    with pytest.raises(ConfigError) as info:
        Config.load(source)
    assert info.value.key == "config"
    assert type(source).__name__ in str(info.value)


@pytest.mark.parametrize("section", ["fp16", "zero_optimization", "optimizer"])
def test_section_that_is_not_an_object(section):
    with pytest.raises(ConfigError) as info:
        load({section: 3})
    assert info.value.key == section
    assert "JSON object" in str(info.value)


# =============================================================================== unknown keys
# Inside a section zerotron knows, an unknown key is an error naming the nearest key (DeepSpeed's
# config models refuse unknown fields too); at the top level, a near miss of a key is an error, and a
# section that is neither DeepSpeed's nor zerotron's is a warning.
@pytest.mark.parametrize(
    "extra,key,near",
    [
        ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "stage"),
        ({"fp16": {"enabled": False, "loss_scal": 0}}, "fp16.loss_scal", "loss_scale"),
        ({"optimizer": {"type": "AdamW", "parms": {}}}, "optimizer.parms", "params"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "none", "devise": "cpu"}}},
            "zero_optimization.offload_optimizer.devise",
            "device",
        ),
        ({"zerotron": {"checkpoint_polcy": "none"}}, "zerotron.checkpoint_polcy", "checkpoint_policy"),
        ({"pipeline": {"stage": 1}}, "pipeline.stage", "stages"),
        ({"train_micro_batch_size_per_gpus": 4}, "train_micro_batch_size_per_gpus", "train_micro_batch_size_per_gpu"),
        ({"train_batchsize": 4}, "train_batchsize", "train_batch_size"),
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
        ({"gradient_acumulation_steps": 2}, "gradient_acumulation_steps", "gradient_accumulation_steps"),
    ],
)
def test_a_misspelt_key_is_an_error_that_names_the_nearest_key(extra, key, near):
    with pytest.raises(ConfigError) as info:
        load(extra)
    assert info.value.key == key
    assert f"did you mean '{near}'?" in str(info.value)


def test_an_unknown_key_with_no_near_miss_lists_the_section_keys():
    with pytest.raises(ConfigError) as info:
        load({"bf16": {"enabled": True, "xyzzy": 1}})
    assert info.value.key == "bf16.xyzzy" and "its keys: enabled" in str(info.value)


def test_an_unknown_top_level_section_warns_with_its_name():
    with pytest.warns(UserWarning, match=r"neither DeepSpeed's nor zerotron's: my_own_settings") as record:
        cfg = Config.load({"train_batch_size": 8, "my_own_settings": {"a": 1}})
    assert triple(cfg) == (8, 8, 1)
    assert len(zerotron_warnings(record)) == 1
    assert record[0].filename == __file__  # the warning points at the caller's line, not at zerotron


def test_every_key_deepspeed_accepts_in_a_section_zerotron_knows_is_accepted():
    """DeepSpeed 0.19.8's fields of the sections zerotron parses (read off its pydantic models and
    its pipeline/activation-checkpointing dicts): none is refused as a typo."""
    zero = [
        "allgather_bucket_size",
        "allgather_partitions",
        "allgather_sequential",
        "compute_grad_norm",
        "contiguous_gradients",
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
        "elastic_checkpoint",
        "enable_sanity_checks",
        "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters",
        "leaf_module",
        "legacy_stage1",
        "load_from_fp32_weights",
        "log_trace_cache_warnings",
        "max_live_parameters",
        "max_reuse_distance",
        "memory_efficient_linear",
        "model_persistence_threshold",
        "module_granularity_threshold",
        "overlap_comm",
        "override_module_apply",
        "param_persistence_threshold",
        "parameter_alignment",
        "pipeline_loading_checkpoint",
        "prefetch_bucket_size",
        "reduce_bucket_size",
        "reduce_scatter",
        "round_robin_gradients",
        "save_muon_momentum_buffer_in_memory",
        "stage",
        "stage3_allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold",
        "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size",
        "stage3_use_all_reduce_for_fetch_params",
        "sub_group_size",
        "use_all_reduce_for_fetch_params",
        "use_multi_rank_bucket_allreduce",
        "zenflow",
        "zero_hpz_partition_size",
        "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_weights",
    ]
    sections = {
        "fp16": [
            "auto_cast",
            "consecutive_hysteresis",
            "enabled",
            "fp16_master_weights_and_grads",
            "hysteresis",
            "initial_scale_power",
            "loss_scale",
            "loss_scale_window",
            "min_loss_scale",
        ],
        "bf16": [
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
            "check_grad_overflow",
            "enabled",
            "immediate_grad_update",
        ],
        "tensorboard": ["enabled", "job_name", "output_path"],
        "csv_monitor": ["enabled", "job_name", "output_path"],
        "wandb": ["enabled", "group", "project", "team"],
        "tensor_parallel": [
            "autotp_size",
            "dtype",
            "injection_policy_tuple",
            "keep_module_on_host",
            "kernel_inject",
            "partition_config",
            "preset_model",
            "replace_with_kernel_inject",
            "tensor_parallel",
            "tp",
            "tp_overlap_comm",
            "vocab_parallel_ce_backend",
            "vocab_parallel_lm_head",
        ],
        "pipeline": [
            "stages",
            "partition",
            "seed_layers",
            "activation_checkpoint_interval",
            "pipe_partitioned",
            "grad_partitioned",
            "use_reentrant",
        ],
        "activation_checkpointing": [
            "partition_activations",
            "number_checkpoints",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
            "cpu_checkpointing",
        ],
        "optimizer": ["type", "params", "legacy_fusion"],
        "scheduler": ["type", "params"],
    }
    offload_param = ["buffer_count", "buffer_size", "device", "max_in_cpu", "nvme_path", "pin_memory"]
    offload_optimizer = [
        "buffer_count",
        "cpuadam_cores_perc",
        "device",
        "fast_init",
        "nvme_path",
        "pin_memory",
        "pipeline_read",
        "pipeline_write",
        "ratio",
        "super_offload",
    ]
    values = {
        "enabled": False,
        "device": "none",
        "stage": 0,
        "type": "AdamW",
        "params": {},
        "stages": 1,
        "tensor_parallel": {},
        "tp": {},
        "zenflow": {},
        "autotp_size": 1,
        "pipeline": {},
    }

    def section(keys):
        return {k: values.get(k, None if k.endswith(("_path", "dtype")) else 1) for k in keys}

    raw = {name: section(keys) for name, keys in sections.items()}
    for key in zero:  # one at a time: some are aliases of others
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load({"zero_optimization": {key: values.get(key, 1)}})
            except ConfigError as e:
                assert "has no key" not in str(e), e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, keys in raw.items():
            try:
                load({name: keys})
            except ConfigError as e:
                assert "has no key" not in str(e), e
        for name, keys in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
            try:
                load({"zero_optimization": {"stage": 3, name: section(keys)}})
            except ConfigError as e:
                assert "has no key" not in str(e), e


def test_known_no_effect_deepspeed_keys_do_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = Config.load(
            {
                "train_batch_size": 8,
                "wall_clock_breakdown": False,
                "memory_breakdown": False,
                "zero_allow_untested_optimizer": True,
                "prescale_gradients": False,
                "flops_profiler": {"enabled": False, "profile_step": 1},
                "comms_logger": {"enabled": False},
                "dump_state": False,
                "steps_per_print": 100,
            }
        )
    assert zerotron_warnings(record) == []
    assert cfg.raw["wall_clock_breakdown"] is False  # kept in the raw dict


def test_a_clean_config_does_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load({"fp16": {"enabled": True, "loss_scale": 0}, "zero_optimization": {"stage": 0}})
    assert zerotron_warnings(record) == []


# =============================================================================== "auto"
ALL_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 0,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def test_resolve_auto_from_values():
    raw = resolve_auto(
        ALL_AUTO,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        bf16=True,
        lr=3e-4,
        betas=[0.8, 0.95],
        eps=1e-6,
        weight_decay=0.1,
        warmup_steps=50,
        warmup_min_lr=1e-5,
        hidden_size=64,
    )
    assert raw == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "fp16": {},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 50},
        },
        "zero_optimization": {
            "stage": 0,
            "reduce_bucket_size": 4096,
            "stage3_prefetch_bucket_size": 3686,
            "stage3_param_persistence_threshold": 640,
        },
    }
    # the input is not modified
    assert ALL_AUTO["train_batch_size"] == "auto" and ALL_AUTO["optimizer"]["params"]["lr"] == "auto"


def test_load_with_auto_values_derives_the_batch():
    cfg = Config.load(ALL_AUTO, world_size=2, micro_batch_size=4, gradient_accumulation_steps=2)
    assert triple(cfg) == (16, 4, 2)
    cfg = Config.load(ALL_AUTO, world_size=4, micro_batch_size=3)
    assert triple(cfg) == (12, 3, 1)
    cfg = Config.load(ALL_AUTO, world_size=2, train_batch_size=32, gradient_accumulation_steps=4)
    assert triple(cfg) == (32, 4, 4)


def test_auto_train_batch_size_derived_from_explicit_micro():
    cfg = Config.load(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
        world_size=4,
    )
    assert triple(cfg) == (24, 2, 3)
    assert "train_batch_size" not in cfg.raw


def test_auto_batch_with_nothing_to_resolve_from():
    with pytest.raises(ConfigError) as info:
        Config.load(ALL_AUTO, world_size=2)
    assert info.value.key == "train_micro_batch_size_per_gpu"
    assert "train_micro_batch_size_per_gpu" in str(info.value)


def test_auto_with_nothing_falls_back_to_defaults():
    cfg = Config.load(ALL_AUTO, world_size=2, micro_batch_size=1)
    assert cfg.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.gradient_clipping == 1.0
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3}  # warmup_num_steps: default
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        None,
        50_000_000,
        100_000,
    )  # reduce_bucket_size unset: the engine's rule (zero/flat.py)


def test_none_values_count_as_not_given():
    raw = resolve_auto(
        {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "train_micro_batch_size_per_gpu": "auto"},
        lr=None,
        micro_batch_size=None,
    )
    assert raw == {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_scheduler_warmup_max_lr_follows_the_optimizer_lr():
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}
    # an explicit optimizer lr
    raw = resolve_auto({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": sched})
    assert raw["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    # an "auto" optimizer lr resolved from lr=
    raw = resolve_auto({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": sched}, lr=5e-4)
    assert raw["optimizer"]["params"]["lr"] == 5e-4 and raw["scheduler"]["params"]["warmup_max_lr"] == 5e-4
    # an "auto" optimizer lr with nothing given: both take the default
    raw = resolve_auto({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": sched})
    assert raw["optimizer"]["params"]["lr"] == 1e-3 and raw["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    # no optimizer block at all
    raw = resolve_auto({"scheduler": sched})
    assert raw["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    raw = resolve_auto({"scheduler": sched}, lr=2e-2)
    assert raw["scheduler"]["params"]["warmup_max_lr"] == 2e-2
    # an explicit warmup_max_lr is left alone
    raw = resolve_auto({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.5}}}, lr=2e-2)
    assert raw["scheduler"]["params"]["warmup_max_lr"] == 0.5


def test_total_num_steps_auto_needs_a_value():
    raw = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": "auto"}},
    }
    with pytest.raises(ConfigError) as info:
        resolve_auto(raw)
    assert info.value.key == "scheduler.params.total_num_steps"
    assert "scheduler.params.total_num_steps" in str(info.value) and "total_steps=" in str(info.value)
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps"):
        Config.load(raw)
    cfg = Config.load(raw, total_steps=1000)
    assert cfg.scheduler.params["total_num_steps"] == 1000


def test_hidden_size_sets_bucket_sizes():
    raw = {
        "train_batch_size": 8,
        "zero_optimization": {
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    cfg = Config.load(raw, hidden_size=1024)
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 1_048_576  # 1024**2
    assert z.stage3_prefetch_bucket_size == 943_718  # int(0.9 * 1024**2)
    assert z.stage3_param_persistence_threshold == 10_240  # 10 * 1024
    # an explicit value beats the one derived from hidden_size
    cfg = Config.load(raw, hidden_size=1024, reduce_bucket_size=1000)
    assert cfg.zero_optimization.reduce_bucket_size == 1000
    # hidden_size only fills "auto" keys
    cfg = Config.load({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 77}}, hidden_size=1024)
    assert cfg.zero_optimization.reduce_bucket_size == 77


def test_bf16_and_fp16_auto():
    cfg = Config.load({"train_batch_size": 8, "bf16": {"enabled": "auto"}}, bf16=True)
    assert cfg.bf16.enabled is True and cfg.model_dtype_name == "bf16"
    cfg = Config.load({"train_batch_size": 8, "bf16": {"enabled": "auto"}})
    assert cfg.bf16.enabled is False and cfg.model_dtype_name == "fp32"
    cfg = Config.load({"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, fp16=True)
    assert cfg.fp16.enabled is True and cfg.bf16.enabled is False and cfg.model_dtype_name == "fp16"
    with pytest.raises(ConfigError, match="fp16.enabled"):
        Config.load(
            {"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, fp16=True, bf16=True
        )


def test_gradient_clipping_auto():
    assert Config.load({"train_batch_size": 8, "gradient_clipping": "auto"}, max_grad_norm=0.5).gradient_clipping == 0.5
    assert Config.load({"train_batch_size": 8, "gradient_clipping": "auto"}).gradient_clipping == 1.0


def test_auto_values_are_validated_after_resolution():
    with pytest.raises(ConfigError, match="optimizer.params.betas"):
        Config.load(
            {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, betas=[0.9, 1.5]
        )
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        Config.load({"train_micro_batch_size_per_gpu": "auto"}, micro_batch_size=0)


# =============================================================================== sources load the same
SOURCE = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale_window": 100, "hysteresis": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8},
    "wall_clock_breakdown": False,
}


def test_path_dict_json_string_and_config_load_the_same(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SOURCE, indent=2))
    from_dict = Config.load(SOURCE, world_size=2)
    from_str_path = Config.load(str(path), world_size=2)
    from_pathlib = Config.load(pathlib.Path(path), world_size=2)
    from_inline = Config.load(json.dumps(SOURCE), world_size=2)
    from_inline_ws = Config.load("  \n" + json.dumps(SOURCE), world_size=2)
    from_config = Config.load(from_dict, world_size=2)
    for cfg in (from_str_path, from_pathlib, from_inline, from_inline_ws, from_config):
        assert cfg == from_dict
        assert cfg.raw == SOURCE
    assert triple(from_dict) == (16, 4, 2)
    assert from_dict.fp16.hysteresis == 3 and from_dict.zero_optimization.reduce_bucket_size == 500_000_000


def test_config_round_trips_through_load():
    cfg = Config.load(ALL_AUTO, world_size=2, micro_batch_size=4, lr=1e-4, total_steps=10)
    again = Config.load(cfg, world_size=2)  # no auto values needed: raw holds the resolved values
    assert again == cfg
    assert again.raw == cfg.raw and again.raw is not cfg.raw
    assert "auto" not in json.dumps(cfg.raw)
    assert again.optimizer.params["lr"] == 1e-4
    assert triple(again) == (8, 4, 1)


def test_loading_copies_the_source():
    source = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg = Config.load(source)
    source["optimizer"]["params"]["lr"] = 0.5
    source["train_batch_size"] = 4
    assert cfg.raw["optimizer"]["params"]["lr"] == 1e-3 and cfg.raw[TBS] == 8
    d = cfg.to_dict()
    d["optimizer"]["params"]["lr"] = 0.7
    assert cfg.raw["optimizer"]["params"]["lr"] == 1e-3
    r = read_raw(cfg)
    r[TBS] = 1
    assert cfg.raw[TBS] == 8
    assert cfg.optimizer.params["lr"] == 1e-3


def test_config_built_directly_and_old_bf16_name():
    from zerotron.config import BF16Config

    cfg = Config.load(Config(train_batch_size=8, bf16=BF16Config(enabled=True)), world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.bf16.enabled
    assert Config.load({"train_batch_size": 4, "bfloat16": {"enabled": True}}).bf16.enabled
    with pytest.raises(ConfigError, match="bfloat16"):
        Config.load({"train_batch_size": 4, "bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
