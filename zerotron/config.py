"""DeepSpeed-style JSON config: loading, "auto" values, batch arithmetic and validation.

Everything here is pure: a bad value raises `ConfigError` (naming the key, the value and the
fix) before the engine touches a process group.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from .config_deepspeed import deepspeed_features, deepspeed_names
from .errors import ConfigError

AUTO = "auto"

# DeepSpeed keys we accept but that change nothing about the math here; no warning for them.
_ACCEPTED_NO_EFFECT = {
    "memory_breakdown", "dump_state",
    "zero_force_ds_cpu_optimizer", "dataloader_drop_last", "flops_profiler", "comms_logger",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "gradient_accumulation_dtype",
    "log_level", "timers", "seq_parallel_communication_data_type", "use_data_before_expert_parallel_",
}

def _is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


class IntOrInf(int):
    """Type marker: an integer, or positive infinity (`steps_per_print: inf`, which accelerate writes
    to silence DeepSpeed's progress prints; `step % inf` is never 0 after step 0)."""


# --------------------------------------------------------------------------------------------
# Typed sections. Field names are DeepSpeed's JSON keys; defaults are DeepSpeed's defaults.
# --------------------------------------------------------------------------------------------
@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False

    def validate(self, p: str):
        _check(self.loss_scale >= 0, p + ".loss_scale", self.loss_scale, "use 0 for dynamic scaling or a positive static scale")
        _check(0 <= self.initial_scale_power <= 64, p + ".initial_scale_power", self.initial_scale_power, "use a power of two exponent in [0, 64], e.g. 16")
        _check(self.loss_scale_window >= 1, p + ".loss_scale_window", self.loss_scale_window, "use a positive number of steps, e.g. 1000")
        _check(self.hysteresis >= 1, p + ".hysteresis", self.hysteresis, "use a positive integer, e.g. 2")
        _check(self.min_loss_scale > 0, p + ".min_loss_scale", self.min_loss_scale, "use a positive scale, e.g. 1")


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class OffloadConfig:
    device: str = "none"
    pin_memory: bool = False
    nvme_path: Optional[str] = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    fast_init: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    ratio: float = 1.0

    def validate(self, p: str):
        _check(self.device in ("none", "cpu", "nvme"), p + ".device", self.device, "use 'none', 'cpu' or 'nvme'")


@dataclass
class ZeroConfig:
    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    load_from_fp32_weights: bool = True
    round_robin_gradients: bool = False
    sub_group_size: int = 1_000_000_000
    offload_optimizer: Optional[OffloadConfig] = None
    offload_param: Optional[OffloadConfig] = None
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    ignore_unused_parameters: bool = True
    elastic_checkpoint: bool = False

    def validate(self, p: str):
        _check(self.stage in (0, 1, 2, 3), p + ".stage", self.stage, "use 0 (data parallel), 1, 2 or 3")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
                    "stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
            value = getattr(self, key)
            _check(value > 0, f"{p}.{key}", value, "use a positive number of elements, e.g. 5e8")
        _check(self.stage3_param_persistence_threshold >= 0, p + ".stage3_param_persistence_threshold",
               self.stage3_param_persistence_threshold, "use a non-negative number of elements")
        for key in ("offload_optimizer", "offload_param"):
            off = getattr(self, key)
            if off is None:
                continue
            off.validate(f"{p}.{key}")
            if key == "offload_param" and self.stage != 3:
                continue  # ignored below stage 3 (warned about below)
            _check(off.device != "nvme", f"{p}.{key}.device", off.device,
                   "NVMe offload (ZeRO-Infinity) is not supported by zerotron; use \"cpu\" (host memory) instead")
        if self.offload_optimizer is not None and self.offload_optimizer.device == "cpu":
            _check(self.stage >= 1, f"{p}.offload_optimizer.device", "cpu",
                   "optimizer offload shards the optimizer: it needs zero_optimization.stage 1, 2 or 3")
        if self.offload_param is not None and self.offload_param.device != "none" and self.stage != 3:
            # DeepSpeed offloads parameters only at stage 3 and ignores the key below it.
            warnings.warn(f"{p}.offload_param is ignored at zero_optimization.stage {self.stage} (as DeepSpeed "
                          "ignores it): parameters stay on the device; parameter offload needs stage 3", stacklevel=4)


@dataclass
class OptimizerConfig:
    type: str = "AdamW"
    params: dict = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"
    params: dict = field(default_factory=dict)


@dataclass
class MonitorConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass
class TensorParallelConfig:
    autotp_size: int = 1

    def validate(self, p: str):
        _check(self.autotp_size >= 1, p + ".autotp_size", self.autotp_size, "use a positive integer")


@dataclass
class PipelineConfig:
    """DeepSpeed's "pipeline" section. The PipelineModule decides the stages ("auto" takes its
    num_stages) and the partition; zerotron adds the schedule."""
    stages: int = 1
    schedule: str = "1f1b"   # "gpipe", "1f1b", or "interleaved" (1F1B over the module's virtual stages)
    partition: str = "best"  # accepted for DeepSpeed configs; PipelineModule(partition_method=...) decides
    seed_layers: bool = False
    activation_checkpoint_interval: int = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True

    def validate(self, p: str):
        from .pipe.schedule import SCHEDULES
        _check(self.stages >= 1, p + ".stages", self.stages, "use a positive integer (or \"auto\")")
        _check(self.schedule in SCHEDULES, p + ".schedule", self.schedule, f"use one of {', '.join(SCHEDULES)}")


@dataclass
class ActivationCheckpointingConfig:
    """DeepSpeed's "activation_checkpointing" section (for zerotron.checkpointing.checkpoint)."""
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False   # accepted; torch's allocator already reuses the memory
    number_checkpoints: Optional[int] = None       # accepted; the policy decides what is checkpointed
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass
class ZerotronConfig:
    """Settings zerotron adds to DeepSpeed's schema, in their own "zerotron" section."""
    sequence_parallel: bool = False
    check_tensor_parallel_plan: bool = True  # run a few tokens through the model split and unsplit first
    checkpoint_policy: str = "none"   # activation checkpointing the engine applies: none, every_block, every_k, selective
    checkpoint_every: int = 2         # with every_k: checkpoint one block in this many
    # Fault tolerance (zerotron/watchdog.py, engine.py):
    collective_timeout: Optional[float] = None  # seconds a collective may wait (None: $ZEROTRON_COLLECTIVE_TIMEOUT or 600)
    collective_checks: bool = False   # debug: compare each collective's op/shape/dtype across ranks first
    max_nonfinite_steps: int = 8      # bf16/fp32: stop after this many consecutive steps with NaN/Inf gradients
    save_on_preemption: Optional[str] = None  # SIGTERM/SIGINT: finish the step, checkpoint here, exit 75

    def validate(self, p: str):
        from .checkpointing import POLICIES
        _check(self.checkpoint_policy in POLICIES, p + ".checkpoint_policy", self.checkpoint_policy,
               f"use one of {', '.join(POLICIES)}")
        _check(self.checkpoint_every >= 1, p + ".checkpoint_every", self.checkpoint_every, "use a positive integer")
        _check(self.collective_timeout is None or self.collective_timeout > 0, p + ".collective_timeout",
               self.collective_timeout, "use a positive number of seconds")
        _check(self.max_nonfinite_steps >= 1, p + ".max_nonfinite_steps", self.max_nonfinite_steps,
               "use a positive integer")


@dataclass(eq=True)
class Config(Mapping):
    """The resolved training config. Build it with `Config.load(path_or_dict, world_size=...)`.

    Also a read-only Mapping over DeepSpeed's key names and the resolved values, as code written
    for DeepSpeed reads `engine.config` (`engine.config.get("zero_optimization", {}).get("stage")`,
    `engine.config["train_batch_size"]`): every top-level key of the JSON (unknown ones included,
    as written) plus every section zerotron parses, with "auto" and the batch triple resolved;
    sections are plain dicts (copies: editing them changes nothing). `raw` is the JSON as given
    (after renaming DeepSpeed's aliases and resolving "auto"); attributes stay the typed view."""
    train_batch_size: Optional[int] = None
    train_micro_batch_size_per_gpu: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    gradient_clipping: float = 1.0  # DeepSpeed's default
    steps_per_print: IntOrInf = 10
    wall_clock_breakdown: bool = False  # time the pipeline stages (pipeline_bubble); synchronizes the device
    communication_data_type: Optional[str] = None
    zero_allow_untested_optimizer: bool = False  # ZeRO 1-3: run an optimizer the elementwise probe could not clear
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    zerotron: ZerotronConfig = field(default_factory=ZerotronConfig)
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: MonitorConfig = field(default_factory=MonitorConfig)
    raw: dict = field(default_factory=dict, repr=False)
    world_size: int = 1

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def load(cls, source, *, world_size: int = 1, pipeline_stages: int | None = None, **auto_values) -> "Config":
        """Parse a path, dict or Config for `world_size` processes; resolve "auto" from
        `auto_values` (see `resolve_auto`); validate everything. `pipeline_stages`: the stages of
        the PipelineModule being trained, which the config's pipeline.stages must agree with."""
        raw = read_raw(source)
        if pipeline_stages is not None:
            raw = copy.deepcopy(raw)
            section = raw.setdefault("pipeline", {})
            given = section.get("stages", AUTO)
            if not _is_auto(given) and given != pipeline_stages:
                raise ConfigError("pipeline.stages", given, f"the PipelineModule has {pipeline_stages} stages; "
                                  "make them agree (or use \"auto\")")
            section["stages"] = pipeline_stages
        raw = deepspeed_names(raw)
        raw = resolve_auto(raw, **auto_values)
        if "bfloat16" in raw:  # DeepSpeed's older name for the bf16 section
            if "bf16" in raw:
                raise ConfigError("bfloat16", raw["bfloat16"], "both 'bf16' and its old name 'bfloat16' are set; keep 'bf16'")
            raw["bf16"] = raw.pop("bfloat16")
        cfg = _parse(cls, deepspeed_features(raw), "")
        cfg.raw = raw
        cfg.world_size = world_size
        cfg._validate()
        return cfg

    @property
    def dp_size(self) -> int:
        """Data-parallel size: the world divided by the model-parallel sizes."""
        return self.world_size // (self.tensor_parallel.autotp_size * self.pipeline.stages)

    # ---- convenience -----------------------------------------------------------------------
    @property
    def model_dtype_name(self) -> str:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    def to_dict(self) -> dict:
        return copy.deepcopy(self.raw)

    # ---- read-only Mapping over DeepSpeed's keys (engine.config.get(...)) --------------------
    def _resolved(self) -> dict:
        out = {k: v for k, v in self.raw.items()}
        for f in dataclasses.fields(self):
            if f.name in ("raw", "world_size"):
                continue
            value = getattr(self, f.name)
            if value is None:
                out.pop(f.name, None)
                continue
            if dataclasses.is_dataclass(value):
                given = self.raw.get(f.name)
                value = _section_dict(value, given if isinstance(given, dict) else {})
            out[f.name] = value
        return out

    def __getitem__(self, key):
        return copy.deepcopy(self._resolved()[key])

    def __iter__(self):
        return iter(self._resolved())

    def __len__(self):
        return len(self._resolved())

    def __contains__(self, key):
        return key in self._resolved()

    def __bool__(self):  # a Config is always a config, even one with few keys
        return True

    __hash__ = None

    # ---- validation ------------------------------------------------------------------------
    def _validate(self):
        _check(self.world_size >= 1, "world_size", self.world_size, "the number of processes must be >= 1")
        self.tensor_parallel.validate("tensor_parallel")
        self.pipeline.validate("pipeline")
        self.zerotron.validate("zerotron")
        model_parallel = self.tensor_parallel.autotp_size * self.pipeline.stages
        _check(self.world_size % model_parallel == 0, "tensor_parallel.autotp_size", self.tensor_parallel.autotp_size,
               f"tensor ({self.tensor_parallel.autotp_size}) x pipeline ({self.pipeline.stages}) parallel size must "
               f"divide the number of processes ({self.world_size})")
        _check(not (self.fp16.enabled and self.bf16.enabled), "fp16.enabled", True,
               "fp16 and bf16 are both enabled; enable at most one of them")
        _check(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping,
               "use 0 to disable clipping or a positive max norm, e.g. 1.0")
        _check(self.steps_per_print >= 1, "steps_per_print", self.steps_per_print, "use a positive integer")
        _check(self.communication_data_type in (None, "fp32", "fp16", "bf16"), "communication_data_type",
               self.communication_data_type, "use 'fp32', 'fp16' or 'bf16' (or leave it out to reduce in the gradient dtype)")
        self.fp16.validate("fp16")
        self.zero_optimization.validate("zero_optimization")
        if self.zerotron.sequence_parallel and self.tensor_parallel.autotp_size == 1:
            warnings.warn("zerotron.sequence_parallel has no effect without tensor parallelism "
                          "(tensor_parallel.autotp_size > 1)", stacklevel=3)
        _check(not self.wandb.enabled, "wandb.enabled", True,
               "zerotron does not log to Weights & Biases; use 'tensorboard' or 'csv_monitor'")
        if self.optimizer is not None:
            from .optim import validate_optimizer
            off = self.zero_optimization.offload_optimizer
            validate_optimizer(self.optimizer.type, self.optimizer.params, zero_stage=self.zero_optimization.stage,
                               on_host=off is not None and off.device == "cpu")
        if self.scheduler is not None:
            from .schedulers import validate_scheduler
            validate_scheduler(self.scheduler.type, self.scheduler.params)
        self._resolve_batch()

    def _resolve_batch(self):
        """train_batch_size = micro x accumulation x data-parallel size; any two give the third.

        With tensor parallelism (no pipeline), DeepSpeed's AutoTP counts train_batch_size over all
        ranks (its batch arithmetic uses the world size: the Transformers Trainer fills "auto" as
        world x micro x accumulation, and accelerate feeds the tensor-parallel ranks of one replica
        the same batch). A batch that only adds up that way is accepted, and train_batch_size is
        then the samples one step really trains on (micro x accumulation x data-parallel size)."""
        try:
            self._resolve_batch_over(self.dp_size)
        except ConfigError:
            tp = self.tensor_parallel.autotp_size
            if tp == 1 or self.pipeline.stages != 1:
                raise
            given = (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
            try:
                self._resolve_batch_over(self.world_size)
            except ConfigError:
                self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = given
                self._resolve_batch_over(self.dp_size)  # raise the data-parallel message
            self.train_batch_size = (self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps
                                     * self.dp_size)

    def _resolve_batch_over(self, dp: int):
        tbs, mbs, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                         self.gradient_accumulation_steps)
        for key, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                       ("gradient_accumulation_steps", gas)):
            _check(v is None or v >= 1, key, v, "use a positive integer")
        if tbs is None and mbs is None:
            raise ConfigError("train_micro_batch_size_per_gpu", None,
                              "set train_micro_batch_size_per_gpu or train_batch_size")
        if tbs is not None and mbs is not None and gas is not None:
            _check(tbs == mbs * gas * dp, "train_batch_size", tbs,
                   f"it must equal train_micro_batch_size_per_gpu ({mbs}) x gradient_accumulation_steps "
                   f"({gas}) x data-parallel size ({dp}) = {mbs * gas * dp}; fix one of them or leave one out")
        elif tbs is not None and mbs is not None:
            _check(tbs % (mbs * dp) == 0, "train_batch_size", tbs,
                   f"it must be divisible by train_micro_batch_size_per_gpu ({mbs}) x data-parallel size ({dp})")
            gas = tbs // (mbs * dp)
        elif tbs is not None:
            gas = gas or 1
            _check(tbs % (gas * dp) == 0, "train_batch_size", tbs,
                   f"it must be divisible by gradient_accumulation_steps ({gas}) x data-parallel size ({dp})")
            mbs = tbs // (gas * dp)
        else:
            gas = gas or 1
            tbs = mbs * gas * dp
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tbs, mbs, gas


def _section_dict(section, given: dict) -> dict:
    """A parsed section as a plain dict with DeepSpeed's keys: the given keys zerotron does not
    model, then every field's resolved value (nested sections likewise; an unset optional one is
    left out)."""
    out = dict(given)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value is None and f.name not in given:
            continue
        if dataclasses.is_dataclass(value):
            sub = given.get(f.name)
            value = _section_dict(value, sub if isinstance(sub, dict) else {})
        out[f.name] = copy.deepcopy(value)
    return out


def _check(ok: bool, key: str, value, fix: str):
    if not ok:
        raise ConfigError(key, value, fix)


# --------------------------------------------------------------------------------------------
# Raw loading
# --------------------------------------------------------------------------------------------
def read_raw(source) -> dict:
    """A deep copy of the raw dict behind a path, a JSON string, a dict or a Config."""
    if isinstance(source, Config):
        if source.raw:
            return copy.deepcopy(source.raw)
        return _to_raw(source)  # built directly, Config(train_batch_size=8, ...)
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            if path.lstrip().startswith("{"):
                return _parse_json(path, "<inline JSON>")
            raise ConfigError("config", path, "no such file; pass the path of a DeepSpeed JSON config, a dict or a zerotron.Config")
        with open(path) as f:
            return _parse_json(f.read(), path)
    raise ConfigError("config", type(source).__name__, "pass a path to a JSON file, a dict or a zerotron.Config")


def _to_raw(cfg) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("raw", "world_size") or value is None:
            continue
        out[f.name] = _to_raw(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def _parse_json(text: str, where: str) -> dict:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("config", where, f"not valid JSON ({e}); fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError("config", where, "the JSON must be an object at the top level")
    return raw


# --------------------------------------------------------------------------------------------
# "auto" values: (path, name in auto_values, what to do when the caller gave no value)
# --------------------------------------------------------------------------------------------
_DROP = object()      # fall back to the key's default (or derive it, for the batch triple)
_REQUIRED = object()  # no sensible default: the user must say

_AUTO_RULES = [
    ("train_batch_size", "train_batch_size", _DROP),
    ("train_micro_batch_size_per_gpu", "micro_batch_size", _DROP),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", _DROP),
    ("gradient_clipping", "max_grad_norm", _DROP),
    ("fp16.enabled", "fp16", _DROP),
    ("bf16.enabled", "bf16", _DROP),
    ("optimizer.params.lr", "lr", _DROP),
    ("optimizer.params.betas", "betas", _DROP),
    ("optimizer.params.eps", "eps", _DROP),
    ("optimizer.params.weight_decay", "weight_decay", _DROP),
    ("scheduler.params.warmup_min_lr", "warmup_min_lr", 0.0),
    ("scheduler.params.warmup_max_lr", "lr", "optimizer.params.lr"),
    ("scheduler.params.warmup_num_steps", "warmup_steps", _DROP),
    ("scheduler.params.total_num_steps", "total_steps", _REQUIRED),
    ("pipeline.stages", "pipeline_stages", 1),
    ("zero_optimization.reduce_bucket_size", "reduce_bucket_size", _DROP),
    ("zero_optimization.stage3_prefetch_bucket_size", "stage3_prefetch_bucket_size", _DROP),
    ("zero_optimization.stage3_param_persistence_threshold", "stage3_param_persistence_threshold", _DROP),
]
_OPTIMIZER_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
_AUTO_MEANS_DEFAULT = {"zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard", "wandb", "csv_monitor",
                       "comet", "comms_logger", "compile", "hybrid_engine", "tensor_parallel", "timers"}


def resolve_auto(raw: dict, **values) -> dict:
    """Replace "auto" values in a raw DeepSpeed config dict.

    `values` use the names a training script knows: micro_batch_size, gradient_accumulation_steps,
    train_batch_size, lr, betas, eps, weight_decay, max_grad_norm, fp16, bf16, warmup_steps,
    total_steps, warmup_min_lr, and hidden_size (which sets the ZeRO bucket sizes the way the
    Transformers Trainer does). A None value counts as not given. Keys with nothing to resolve
    from fall back to their defaults, as do all other "auto" values inside the sections DeepSpeed
    parses with its pydantic models (zero_optimization, fp16, bf16, the monitors, tensor_parallel,
    ...), where DeepSpeed reads "auto" as the default; keys without a sensible default raise ConfigError.
    """
    raw = copy.deepcopy(raw)
    known = {name for _, name, _ in _AUTO_RULES} | {"hidden_size"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"resolve_auto got unknown value names {unknown}; known: {sorted(known)}")
    values = {k: v for k, v in values.items() if v is not None}
    hidden = values.pop("hidden_size", None)
    if hidden is not None:
        values.setdefault("reduce_bucket_size", hidden * hidden)
        values.setdefault("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        values.setdefault("stage3_param_persistence_threshold", 10 * hidden)
    for path, name, fallback in _AUTO_RULES:
        parent, key = _walk(raw, path)
        if parent is None or not _is_auto(parent.get(key)):
            continue
        if name in values:
            parent[key] = values[name]
        elif fallback is _DROP:
            if path.startswith("optimizer.params."):
                parent[key] = _OPTIMIZER_DEFAULTS[key]
            else:
                del parent[key]
        elif fallback is _REQUIRED:
            raise ConfigError(path, AUTO, f"nothing to resolve it from; set a number or pass {name}=... "
                              "to zerotron.resolve_auto(config, ...)")
        elif isinstance(fallback, str):  # another key's (resolved) value
            src_parent, src_key = _walk(raw, fallback)
            src = None if src_parent is None else src_parent.get(src_key)
            parent[key] = _OPTIMIZER_DEFAULTS["lr"] if src is None or _is_auto(src) else src
        else:
            parent[key] = fallback
    for path in list(_auto_paths(raw, "")):
        # In the sections DeepSpeed reads through its pydantic models, "auto" means the default
        # (DeepSpeedConfigModel drops such values), e.g. zero_optimization.stage3_max_live_parameters.
        if path.split(".")[0] in _AUTO_MEANS_DEFAULT:
            parent, key = _walk(raw, path)
            del parent[key]
    left = [p for p in _auto_paths(raw, "")]
    if left:
        raise ConfigError(left[0], AUTO, "zerotron cannot resolve 'auto' for this key; set a value")
    return raw


def _walk(raw: dict, path: str):
    *parents, key = path.split(".")
    node = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, key
    return node, key


def _auto_paths(node, prefix):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _auto_paths(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    elif _is_auto(node):
        yield prefix


# --------------------------------------------------------------------------------------------
# Typed parsing of dataclass sections
# --------------------------------------------------------------------------------------------
def _parse(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "config", raw, "expected a JSON object here")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.name not in ("raw", "world_size")}
    kwargs, unknown = {}, []
    for key, value in raw.items():
        if key not in names:
            if not (prefix == "" and key in _ACCEPTED_NO_EFFECT):
                unknown.append(prefix + key)
            continue
        kwargs[key] = _convert(hints[key], value, prefix + key)
    if unknown:
        warnings.warn(f"zerotron ignores unknown config keys: {', '.join(unknown)}", stacklevel=3)
    return cls(**kwargs)


def _convert(tp, value, key: str):
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return None if value is None else _convert(inner, value, key)
    if dataclasses.is_dataclass(tp):
        return _parse(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "expected true or false")
    if tp is IntOrInf:
        if value == math.inf or (isinstance(value, str) and value.strip().lower() in ("inf", "infinity")):
            return math.inf
        tp = int
    if tp is int:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not value.is_integer())):
            raise ConfigError(key, value, "expected an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(key, value, "expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a string")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "expected a JSON object")
        return dict(value)
    return value
