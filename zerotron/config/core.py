"""The resolved config (`Config`): loading from any source, batch arithmetic, the checks that span
sections, and the read-only mapping over DeepSpeed's key names that DeepSpeed-written code reads."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from ..log import warn
from .deepspeed import deepspeed_features, deepspeed_names
from .profiling import CommsLoggerConfig, FlopsProfilerConfig
from .resolve import parse_json, parse_section, resolve_auto
from .scheduler_section import validate_scheduler
from .sections import (
    AUTO,
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    ExpertParallelConfig,
    FP16Config,
    IntOrInf,
    MonitorConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
    WandbConfig,
    ZeroConfig,
    ZerotronConfig,
    check,
    is_auto,
)


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
    zero_force_ds_cpu_optimizer: Optional[bool] = None  # true: refuse a client optimizer under offload (optim/build.py)
    sequence_parallel_size: int = 1  # Ulysses: each sample's sequence split over this many ranks (docs/parallelism.md)
    data_parallel_size: Optional[int] = None  # DeepSpeed's key beside it: must be what the other sizes leave
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saved training state (tag checks)
    zerotron: ZerotronConfig = field(default_factory=ZerotronConfig)
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    raw: dict = field(default_factory=dict, repr=False)
    world_size: int = 1

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        source,
        *,
        world_size: int = 1,
        pipeline_stages: int | None = None,
        sequence_parallel_size: int | None = None,
        **auto_values,
    ) -> "Config":
        """Parse a path, dict or Config for `world_size` processes; resolve "auto" from
        `auto_values` (see `resolve_auto`); validate everything. `pipeline_stages`: the stages of
        the PipelineModule being trained, which the config's pipeline.stages must agree with;
        `sequence_parallel_size`: the one a sequence-parallel mpu set up (parallel_state_sp)."""
        raw = read_raw(source)
        if sequence_parallel_size is not None:
            given = raw.get("sequence_parallel_size", sequence_parallel_size)
            if given != sequence_parallel_size:
                raise ConfigError(
                    "sequence_parallel_size",
                    given,
                    f"initialize(mpu=...) set up {sequence_parallel_size} sequence-parallel ranks; make them agree",
                )
            raw = {**raw, "sequence_parallel_size": sequence_parallel_size}
        if pipeline_stages is not None:
            raw = copy.deepcopy(raw)
            section = raw.setdefault("pipeline", {})
            given = section.get("stages", AUTO)
            if not is_auto(given) and given != pipeline_stages:
                raise ConfigError(
                    "pipeline.stages",
                    given,
                    f'the PipelineModule has {pipeline_stages} stages; make them agree (or use "auto")',
                )
            section["stages"] = pipeline_stages
        raw = deepspeed_names(raw)
        raw = resolve_auto(raw, **auto_values)
        if "bfloat16" in raw:  # DeepSpeed's older name for the bf16 section
            if "bf16" in raw:
                raise ConfigError(
                    "bfloat16", raw["bfloat16"], "both 'bf16' and its old name 'bfloat16' are set; keep 'bf16'"
                )
            raw["bf16"] = raw.pop("bfloat16")
        cfg = parse_section(cls, deepspeed_features(raw), "")
        cfg.raw = raw
        cfg.world_size = world_size
        cfg._validate()
        return cfg

    @property
    def dp_size(self) -> int:
        """Data-parallel size: the world divided by the model- and sequence-parallel sizes (the
        ranks that read different samples; DeepSpeed's batch arithmetic divides by the sequence
        size too)."""
        return self.world_size // (
            self.tensor_parallel.autotp_size
            * self.pipeline.stages
            * self.sequence_parallel_size
            * self.zerotron.context_parallel_size
        )

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
        check(self.world_size >= 1, "world_size", self.world_size, "the number of processes must be >= 1")
        self.tensor_parallel.validate("tensor_parallel")
        self.expert_parallel.validate("expert_parallel")
        self.pipeline.validate("pipeline")
        self.zerotron.validate("zerotron")
        tp, pp = self.tensor_parallel.autotp_size, self.pipeline.stages
        self._validate_sequence_parallel(tp, pp)
        dp, fix = self.data_parallel_size, f"the sizes and {self.world_size} processes leave {self.dp_size}; match it"
        check(dp in (None, self.dp_size) or self.world_size % (tp * pp), "data_parallel_size", dp, fix)
        if self.world_size % (tp * pp):
            # blame the size the user set (the pipeline's when both are)
            key, value = ("tensor_parallel.autotp_size", tp) if pp == 1 else ("pipeline.stages", pp)
            product = f"tensor ({tp}) x pipeline ({pp}) parallel size" if tp > 1 and pp > 1 else "it"
            raise ConfigError(
                key,
                value,
                f"{product} must divide the number of processes ({self.world_size}); "
                f"use a divisor of {self.world_size} or launch a multiple of {tp * pp} processes",
            )
        check(
            not (self.fp16.enabled and self.bf16.enabled),
            "fp16.enabled",
            True,
            "fp16 and bf16 are both enabled; enable at most one of them",
        )
        check(
            self.gradient_clipping >= 0,
            "gradient_clipping",
            self.gradient_clipping,
            "use 0 to disable clipping or a positive max norm, e.g. 1.0",
        )
        check(self.steps_per_print >= 1, "steps_per_print", self.steps_per_print, "use a positive integer")
        check(
            self.communication_data_type in (None, "fp32", "fp16", "bf16"),
            "communication_data_type",
            self.communication_data_type,
            "use 'fp32', 'fp16' or 'bf16' (or leave it out to reduce in the gradient dtype)",
        )
        self.fp16.validate("fp16")
        self.zero_optimization.validate("zero_optimization")
        self.checkpoint.validate("checkpoint")
        if self.zerotron.sequence_parallel and self.tensor_parallel.autotp_size == 1:
            warn(
                "zerotron.sequence_parallel has no effect without tensor parallelism (tensor_parallel.autotp_size > 1)"
            )
        check(
            not self.wandb.enabled,
            "wandb.enabled",
            True,
            "zerotron does not log to Weights & Biases; use 'tensorboard' or 'csv_monitor'",
        )
        if self.optimizer is not None:
            from ..optim import validate_optimizer

            off = self.zero_optimization.offload_optimizer
            validate_optimizer(
                self.optimizer.type,
                self.optimizer.params,
                zero_stage=self.zero_optimization.stage,
                on_host=off is not None and off.device == "cpu",
            )
        if self.scheduler is not None:
            validate_scheduler(self.scheduler.type, self.scheduler.params)
        self._resolve_batch()
        check(
            not self.tensor_parallel.tp_overlap_comm or self.train_micro_batch_size_per_gpu >= 2,
            "tensor_parallel.tp_overlap_comm",
            True,
            f"it splits each micro-batch in two halves, and "
            f"train_micro_batch_size_per_gpu is {self.train_micro_batch_size_per_gpu}; use 2 or more, or remove it",
        )

    def _validate_sequence_parallel(self, tp: int, pp: int):
        sp, cp = self.sequence_parallel_size, self.zerotron.context_parallel_size
        for key, size, what in (
            ("sequence_parallel_size", sp, "sequence parallelism"),
            ("zerotron.context_parallel_size", cp, "ring attention"),
        ):
            check(
                isinstance(size, int) and not isinstance(size, bool) and size >= 1,
                key,
                size,
                f"use a positive integer (1: no {what})",
            )
        if sp * cp == 1:
            return
        key, size = ("sequence_parallel_size", sp) if sp > 1 else ("zerotron.context_parallel_size", cp)
        check(
            self.world_size % (sp * cp * tp * pp) == 0,
            key,
            size,
            f"sequence ({sp}) x context ({cp}) parallel size must divide the number of processes ({self.world_size}) "
            f"together with the tensor ({tp}) and pipeline ({pp}) sizes; use divisors of "
            f"{self.world_size // (tp * pp)} or launch a multiple of {sp * cp * tp * pp} processes",
        )
        for n, what, other in ((tp, "tensor", "tensor_parallel.autotp_size"), (pp, "pipeline", "pipeline.stages")):
            check(
                n == 1,
                key,
                size,
                f"sequence parallelism with {what} parallelism ({other} {n}) is not supported yet: use one of them",
            )

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
            self.train_batch_size = (
                self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.dp_size
            )

    def _resolve_batch_over(self, dp: int):
        tbs, mbs, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
        for key, v in (
            ("train_batch_size", tbs),
            ("train_micro_batch_size_per_gpu", mbs),
            ("gradient_accumulation_steps", gas),
        ):
            check(v is None or v >= 1, key, v, "use a positive integer")
        if tbs is None and mbs is None:
            raise ConfigError(
                "train_micro_batch_size_per_gpu", None, "set train_micro_batch_size_per_gpu or train_batch_size"
            )
        if tbs is not None and mbs is not None and gas is not None:
            check(
                tbs == mbs * gas * dp,
                "train_batch_size",
                tbs,
                f"it must equal train_micro_batch_size_per_gpu ({mbs}) x gradient_accumulation_steps "
                f"({gas}) x data-parallel size ({dp}) = {mbs * gas * dp}; fix one of them or leave one out",
            )
        elif tbs is not None and mbs is not None:
            check(
                tbs % (mbs * dp) == 0,
                "train_batch_size",
                tbs,
                f"it must be divisible by train_micro_batch_size_per_gpu ({mbs}) x data-parallel size ({dp})",
            )
            gas = tbs // (mbs * dp)
        elif tbs is not None:
            gas = gas or 1
            check(
                tbs % (gas * dp) == 0,
                "train_batch_size",
                tbs,
                f"it must be divisible by gradient_accumulation_steps ({gas}) x data-parallel size ({dp})",
            )
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
                return parse_json(path, "<inline JSON>")
            raise ConfigError(
                "config", path, "no such file; pass the path of a DeepSpeed JSON config, a dict or a zerotron.Config"
            )
        with open(path) as f:
            return parse_json(f.read(), path)
    raise ConfigError("config", type(source).__name__, "pass a path to a JSON file, a dict or a zerotron.Config")


def _to_raw(cfg) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("raw", "world_size") or value is None:
            continue
        out[f.name] = _to_raw(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out
