"""zerotron: a distributed training engine for PyTorch, in pure Python, with DeepSpeed's API.

import zerotron as deepspeed
engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(model=model, config="ds.json")
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from . import activation_checkpointing, error_report, hf, watchdog  # noqa: F401 (zerotron.hf as DeepSpeed users expect)
from .comm import init_distributed, launched_by_torchrun, local_device
from .comm import log as comm_log
from .config import Config, resolve_auto
from .engine import Engine
from .engine.hybrid import hybrid_engine_enabled, sync_generation_rng
from .errors import BadBatchError, CollectiveMismatch, ConfigError, NonFiniteError, ZerotronError
from .hf.takeover import hand_back, hold
from .log import logger
from .moe.expert_groups import expert_parallel_size
from .topology import Topology

# `zerotron.checkpointing` is activation checkpointing under DeepSpeed's name (deepspeed.checkpointing);
# the module's own name keeps it apart from checkpoint/ (saved training state).
checkpointing = activation_checkpointing
sys.modules[__name__ + ".checkpointing"] = activation_checkpointing

__version__ = "0.1.0"
__all__ = [
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "Config",
    "ConfigError",
    "Engine",
    "Topology",
    "resolve_auto",
    "BadBatchError",
    "CollectiveMismatch",
    "NonFiniteError",
    "ZerotronError",
    "__version__",
]

if launched_by_torchrun():  # a worker of a launched job: zerotron's errors print as one message, not N tracebacks
    error_report.install()


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """Build the engine; DeepSpeed's signature. Returns (engine, optimizer, dataloader, lr_scheduler).

    The config (path, dict or Config; or `args.deepspeed_config`) is validated completely before any
    process-group work, so a bad value fails fast with a message naming the key and the fix.
    """
    if model is None:
        raise ValueError("zerotron.initialize needs model=")
    if mesh_param is not None:
        raise ValueError(
            "mesh_param= is a DeepSpeed hook zerotron does not take; set tensor/pipeline sizes in the config instead"
        )
    mpu_tp, mpu_sp = _check_mpu(mpu)
    config = _config_source(args, config, config_params)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    from .pipe import PipelineModule

    pipelined = isinstance(model, PipelineModule)
    from .autotuning import resolve as autotune

    config = autotune(config, model, world_size)
    cfg = Config.load(
        config,
        world_size=world_size,
        pipeline_stages=model.num_stages if pipelined else None,
        sequence_parallel_size=mpu_sp,
        **_auto_values(model, optimizer),
    )
    topology = Topology(
        world_size,
        tp=cfg.tensor_parallel.autotp_size,
        pp=cfg.pipeline.stages,
        sp=cfg.sequence_parallel_size,
        cp=cfg.zerotron.context_parallel_size,
        ep=expert_parallel_size(model, cfg.expert_parallel.size),
    )

    init_distributed()
    topology.build_groups(local_device().type)
    _check_mpu_layout(mpu, mpu_tp, topology)
    engine_class = Engine
    if pipelined:
        from .engine import PipelineEngine as engine_class
    if "comms_logger" in cfg.raw:  # as DeepSpeed's engine does, the config sets deepspeed.comm's logger
        comm_log.configure(cfg)
    if "log_level" in cfg.raw:  # DeepSpeed's logger level, for zerotron's logger
        logger.setLevel(str(cfg.raw["log_level"]).upper())
    hand_back(model)  # a model another engine wraps (the Trainer's evaluate() before train()) comes back whole
    engine = engine_class(
        model,
        cfg,
        topology,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        model_parameters=model_parameters,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    hold(engine)
    if not pipelined and hybrid_engine_enabled(cfg.raw):  # DeepSpeed's hybrid engine syncs the ranks' RNG
        sync_generation_rng()
    # An engine built without an optimizer (evaluation, a reference model) returns None in its
    # place, as DeepSpeed does; the engine keeps a placeholder that refuses to step.
    optimizer = None if getattr(engine.optimizer, "placeholder", False) else engine.optimizer
    return engine, optimizer, engine.training_dataloader, engine.lr_scheduler


def _check_mpu(mpu) -> tuple[int | None, int | None]:
    """A Megatron-style model-parallel unit: accepted when it describes what zerotron builds
    itself: data- or sequence-parallel ranks, or the tensor-parallel groups AutoTP splits the model
    over (DeepSpeed's AutoTP training examples pass one beside tensor_parallel.autotp_size; the model
    is whole when it comes in). A pipeline-split model is refused: zerotron splits models itself.
    Returns the mpu's tensor-parallel size and the sequence-parallel size a sequence mpu
    (parallel_state_sp) set up, each None where the mpu does not say (or there is none)."""
    if mpu is None:
        return None, None
    sizes = {}
    for what, names in (
        ("tensor", ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")),
        ("pipeline", ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")),
    ):
        getter = next((getattr(mpu, n) for n in names if hasattr(mpu, n)), None)
        sizes[what] = int(getter()) if getter is not None else None
    if (sizes["pipeline"] or 1) > 1:
        raise ValueError(
            f"initialize(mpu=...) describes a model already split over {sizes['pipeline']} pipeline-parallel "
            "ranks; zerotron splits models itself: pass the unsplit model as a PipelineModule with num_stages"
        )
    getter = getattr(mpu, "get_sequence_parallel_world_size", None)
    return sizes["tensor"], int(getter()) if getter is not None else None


def _check_mpu_layout(mpu, mpu_tp: int | None, topology: Topology) -> None:
    """An mpu's tensor-parallel size must be the config's autotp_size, and its groups (where it
    hands them out) the ones zerotron made: otherwise the script's own collectives (its inputs
    broadcast over the mpu's group) would pair other ranks than the model's split does."""
    if mpu_tp is None:  # no mpu, or one of data- or sequence-parallel ranks only
        return
    if mpu_tp != topology.tp:
        raise ValueError(
            f"initialize(mpu=...) describes {mpu_tp} tensor-parallel ranks but tensor_parallel.autotp_size is "
            f"{topology.tp}; zerotron splits the whole model itself by autotp_size: make the two agree (a model "
            "already split by the script's own tensor-parallel layers cannot be taken: pass the unsplit model)"
        )
    getter = next(
        (getattr(mpu, n) for n in ("get_tensor_model_parallel_group", "get_model_parallel_group") if hasattr(mpu, n)),
        None,
    )
    group = getter() if getter is not None and mpu_tp > 1 else None
    if group is not None:
        ranks = dist.get_process_group_ranks(group)
        ours = topology.group_ranks("tp", dist.get_rank())
        if ranks != ours:
            raise ValueError(
                f"initialize(mpu=...)'s tensor-parallel group on rank {dist.get_rank()} is ranks {ranks}; zerotron "
                f"splits the model over ranks {ours} (tensor-parallel ranks adjacent); build the mpu's groups so"
            )


def _config_source(args, config, config_params):
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError(
            "config",
            None,
            "pass config= (a JSON path, dict or zerotron.Config) or --deepspeed_config on the command line",
        )
    return config


def _auto_values(model, optimizer) -> dict:
    """What "auto" config values can be resolved from, taken from initialize's arguments."""
    values = {}
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes == {torch.bfloat16}:
        values["bf16"] = True
    elif dtypes == {torch.float16}:
        values["fp16"] = True
    if isinstance(optimizer, torch.optim.Optimizer):
        group = optimizer.param_groups[0]
        values.update({k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group})
        values["betas"] = list(values["betas"]) if "betas" in values else None
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or getattr(
        getattr(model, "config", None), "d_model", None
    )
    if isinstance(hidden, int):
        values["hidden_size"] = hidden
    return values


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: --deepspeed and --deepspeed_config (and the old deepscale names)."""
    group = parser.add_argument_group("zerotron", "zerotron / DeepSpeed configuration")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable the engine (accepted for DeepSpeed scripts)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


# ---- DeepSpeed's surface: its module paths below zerotron, its top-level names on first use, and
# the opt-in `deepspeed` alias (zerotron/compat/alias.py; the path table is zerotron/compat/paths.py).
from .compat import alias as _alias  # noqa: E402

as_deepspeed = _alias.as_deepspeed
__all__ += ["as_deepspeed"]


def __getattr__(name: str):
    """PEP 562: `zerotron.get_accelerator`, `zerotron.DeepSpeedEngine`, ... and `zerotron.utils`,
    `zerotron.runtime.zero.partition_parameters`, ... without importing them first."""
    return _alias.top_level(name)


def __dir__():
    return sorted({*globals(), *_alias.paths.NAMES, *(p for p in _alias.paths.PATHS if "." not in p)})


_alias.install()
