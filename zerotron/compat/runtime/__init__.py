"""`deepspeed.runtime`: the engine, pipeline, ZeRO, scheduler, config and helper modules DeepSpeed
scripts import, over zerotron's core."""

from . import (
    activation_checkpointing,
    config,
    constants,
    dataloader,
    engine,
    fp16,
    lr_schedules,
    pipe,  # noqa: F401
    utils,
    zero,
)
