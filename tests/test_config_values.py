"""Config loading: the types and values of keys (errors naming the key, defaults), optimizer names and
DeepSpeed's Adam.

Pure Python: no process groups. Every error case checks that the message names the key.
"""

import math

import pytest
import torch
from config_helpers import GAS, MBS, TBS, load

from zerotron.errors import ConfigError
from zerotron.optim import build_optimizer, validate_optimizer

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
    ({"bf16": {"enabled": 2}}, "bf16.enabled", "expected true or false"),  # (1 and 0 are taken, as by DeepSpeed)
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
