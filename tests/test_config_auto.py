"""Config "auto" values: resolved from the values the caller gives (the batch, the optimizer and scheduler,
precision, clipping, bucket sizes from the hidden size) or else from defaults, then validated.

Pure Python: no process groups.
"""

import pytest
from config_helpers import ALL_AUTO, triple

from zerotron.config import Config, resolve_auto
from zerotron.errors import ConfigError


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
