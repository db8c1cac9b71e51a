"""What the config tests (tests/test_config_*.py) share: a loader on top of {"train_batch_size": 8},
the batch triple of a loaded config, zerotron's warnings among those recorded, the batch keys' names
and a config whose every value DeepSpeed allows to be "auto" is."""

from zerotron.config import Config


def load(extra=None, *, world_size=1, **auto):
    raw = {"train_batch_size": 8}
    raw.update(extra or {})
    return Config.load(raw, world_size=world_size, **auto)


def triple(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


def zerotron_warnings(record):
    return [str(w.message) for w in record if "zerotron" in str(w.message)]


TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


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
