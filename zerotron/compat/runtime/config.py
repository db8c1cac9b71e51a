"""`deepspeed.runtime.config`: DeepSpeedConfig (a view of zerotron.Config with DeepSpeed's
attribute names), DeepSpeedConfigError (= zerotron.ConfigError) and the optimizer name constants."""

from __future__ import annotations

import json

import torch.distributed as dist

from ...config import Config
from ...errors import ConfigError
from ...log import logger

DeepSpeedConfigError = ConfigError

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True


class DeepSpeedConfig:
    """A DeepSpeed config (path, dict, JSON text or zerotron.Config) parsed and validated by
    zerotron.Config for the current world, with DeepSpeed's attribute names. As in DeepSpeed,
    `world_size` is the data-parallel size the batch arithmetic uses; `config` is the zerotron
    Config, whose attributes are reachable here too."""

    def __init__(self, config, mpu=None, mesh_device=None):
        if mpu is not None or mesh_device is not None:
            raise ValueError(
                "mpu= and mesh_device= are Megatron/DeepSpeed hooks zerotron does not take; set "
                "tensor_parallel.autotp_size and pipeline.stages in the config instead"
            )
        initialized = dist.is_initialized()
        self.config = Config.load(config, world_size=dist.get_world_size() if initialized else 1)
        c = self.config
        self._param_dict = c.to_dict()
        self.global_rank = dist.get_rank() if initialized else 0
        self.world_size = c.dp_size
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.steps_per_print = c.steps_per_print
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.communication_data_type = c.communication_data_type
        self.gradient_clipping = c.gradient_clipping
        self.gradient_allreduce_op = "mean"  # the one zerotron's config accepts (it refuses "sum")
        self.zero_config = c.zero_optimization
        self.zero_optimization_stage = c.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config, self.bfloat16_config = c.fp16, c.bf16
        self.fp16_enabled, self.bfloat16_enabled = c.fp16.enabled, c.bf16.enabled
        self.activation_checkpointing_config = c.activation_checkpointing
        self.tensor_parallel_config = c.tensor_parallel
        self.pipeline = c.pipeline
        self.optimizer_name = c.optimizer.type.lower() if c.optimizer is not None else None
        self.optimizer_params = dict(c.optimizer.params) if c.optimizer is not None else None
        self.scheduler_name = c.scheduler.type if c.scheduler is not None else None
        self.scheduler_params = dict(c.scheduler.params or {}) if c.scheduler is not None else None

    def __getattr__(self, name):
        if name == "config":  # not set yet (construction failed): no recursion
            raise AttributeError(name)
        return getattr(self.config, name)

    def print_user_config(self):
        logger.info(f"  json = {json.dumps(self._param_dict, sort_keys=True, indent=4, default=str)}")

    def print(self, name):
        logger.info(f"{name}:")
        for key in sorted(k for k in vars(self) if not k.startswith("_") and k != "config"):
            logger.info(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        self.print_user_config()
