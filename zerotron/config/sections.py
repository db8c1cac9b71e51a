"""The sections of the config (DeepSpeed's JSON schema, plus zerotron's own "zerotron" section):
typed dataclasses with their defaults and per-section checks, and the names they check against
(pipeline schedules, activation-checkpoint policies) kept here as plain data so the config needs
nothing of the modules that implement them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from ..log import warn

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # zerotron/pipe/schedule.py builds each
CHECKPOINT_POLICIES = (
    "none",
    "every_block",
    "every_k",
    "selective",
)  # zerotron/activation_checkpointing.py applies each

AUTO = "auto"


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


def as_bool(value) -> bool | None:
    """A true/false key's value as DeepSpeed reads it, or None when it is not one: JSON true/false, or the
    numbers 1 and 0 (DeepSpeed's pydantic sections take them as true and false, and its plain top-level reads,
    such as zero_allow_untested_optimizer's, test truthiness, which agrees). The one rule for every such key,
    typed field or raw "enabled". Strings are not taken: pydantic reads "false" as false, a plain read as true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return None


def enabled(section) -> bool:
    """Whether a raw section (a dict from the JSON) says "enabled": true (or 1)."""
    return isinstance(section, dict) and as_bool(section.get("enabled", False)) is True


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
        check(
            self.loss_scale >= 0,
            p + ".loss_scale",
            self.loss_scale,
            "use 0 for dynamic scaling or a positive static scale",
        )
        check(
            0 <= self.initial_scale_power <= 64,
            p + ".initial_scale_power",
            self.initial_scale_power,
            "use a power of two exponent in [0, 64], e.g. 16",
        )
        check(self.hysteresis >= 1, p + ".hysteresis", self.hysteresis, "use a positive integer, e.g. 2")
        if not (self.enabled and self.loss_scale == 0):
            return  # the window and the minimum scale are read by dynamic scaling only (DeepSpeed checks them so too)
        check(
            self.loss_scale_window >= 1,
            p + ".loss_scale_window",
            self.loss_scale_window,
            "use a positive number of steps, e.g. 1000",
        )
        check(self.min_loss_scale > 0, p + ".min_loss_scale", self.min_loss_scale, "use a positive scale, e.g. 1")


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
        check(self.device in ("none", "cpu", "nvme"), p + ".device", self.device, "use 'none', 'cpu' or 'nvme'")


@dataclass
class ZeroConfig:
    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    reduce_scatter: bool = True
    # None (unset): zero/flat.py's rule, about OVERLAP_BUCKETS buckets per model (at most DeepSpeed's
    # 5e8 elements each), so the reduction overlaps backward whatever the model's size; a number:
    # the most elements of a bucket, as in DeepSpeed.
    reduce_bucket_size: Optional[int] = None
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
    ignore_unused_parameters: bool = True
    elastic_checkpoint: bool = False
    # Stages 1-2 (zero/sharded.py): free each bucket's full parameters once the boundary backward
    # has reduced its gradients, until the step gathers them again (FSDP2's name and behaviour);
    # start that gather without waiting, each bucket waited on at its first use in the next
    # forward (Megatron-LM's name).
    reshard_after_backward: bool = False
    overlap_param_gather: bool = False

    def validate(self, p: str):
        check(self.stage in (0, 1, 2, 3), p + ".stage", self.stage, "use 0 (data parallel), 1, 2 or 3")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters"):
            value = getattr(self, key)
            check(value is None or value > 0, f"{p}.{key}", value, "use a positive number of elements, e.g. 5e8")
        check(
            self.stage3_prefetch_bucket_size >= 0,
            p + ".stage3_prefetch_bucket_size",
            self.stage3_prefetch_bucket_size,
            "use a number of elements (0: no prefetching), e.g. 5e7",
        )
        check(
            self.stage3_param_persistence_threshold >= 0,
            p + ".stage3_param_persistence_threshold",
            self.stage3_param_persistence_threshold,
            "use a non-negative number of elements",
        )
        for key in ("reshard_after_backward", "overlap_param_gather"):
            check(
                not getattr(self, key) or self.stage in (1, 2),
                f"{p}.{key}",
                True,
                "applies to stages 1 and 2 only (stage 3 gathers and releases each unit itself, and "
                "prefetches by stage3_prefetch_bucket_size); remove it or use stage 1 or 2",
            )
        if not self.ignore_unused_parameters and self.stage not in (1, 2):
            warn(
                f"{p}.ignore_unused_parameters = false is checked at stages 1 and 2 only (as in DeepSpeed): at stage "
                f"{self.stage} parameters without a gradient train with zero gradients"
            )
        for key in ("offload_optimizer", "offload_param"):
            off = getattr(self, key)
            if off is None:
                continue
            off.validate(f"{p}.{key}")
            if key == "offload_param" and self.stage != 3:
                continue  # ignored below stage 3 (warned about below)
            check(
                off.device != "nvme",
                f"{p}.{key}.device",
                off.device,
                'NVMe offload (ZeRO-Infinity) is not supported by zerotron; use "cpu" (host memory) instead',
            )
        if self.offload_optimizer is not None and self.offload_optimizer.device == "cpu":
            check(
                self.stage >= 1,
                f"{p}.offload_optimizer.device",
                "cpu",
                "optimizer offload shards the optimizer: it needs zero_optimization.stage 1, 2 or 3",
            )
        if self.offload_param is not None and self.offload_param.device != "none" and self.stage != 3:
            # DeepSpeed offloads parameters only at stage 3 and ignores the key below it.
            warn(
                f"{p}.offload_param is ignored at zero_optimization.stage {self.stage} (as DeepSpeed "
                "ignores it): parameters stay on the device; parameter offload needs stage 3"
            )


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
class WandbConfig:
    enabled: bool = False
    team: Optional[str] = None
    group: Optional[str] = None
    project: str = "deepspeed"


@dataclass
class TensorParallelConfig:
    autotp_size: int = 1
    # DeepSpeed's key: each attention and MLP block runs its micro-batch in two halves, one half's
    # collective in flight while the other computes (parallel/overlap.py)
    tp_overlap_comm: bool = False

    def validate(self, p: str):
        check(self.autotp_size >= 1, p + ".autotp_size", self.autotp_size, "use a positive integer")
        check(
            not self.tp_overlap_comm or self.autotp_size > 1,
            p + ".tp_overlap_comm",
            True,
            "it overlaps tensor-parallel collectives, and autotp_size is 1; remove it or set autotp_size > 1",
        )


@dataclass
class ExpertParallelConfig:
    """DeepSpeed's AutoEP section ("expert_parallel"): the experts of a Hugging Face MoE model split over
    `autoep_size` ranks (zerotron/moe/stacked_experts.py). The model's own router and expert code run, so
    DeepSpeed's keys that describe the model to its replacement layer are not needed (warned about)."""

    enabled: bool = False
    autoep_size: int = 1
    preset_model: Optional[str] = None  # DeepSpeed's preset name; zerotron finds the experts by their class

    def validate(self, p: str):
        check(self.autoep_size >= 1, p + ".autoep_size", self.autoep_size, "use a positive integer")
        if self.enabled and self.autoep_size == 1:  # as DeepSpeed: a warning, training goes on unsplit
            warn(f"{p}.enabled with autoep_size 1 splits nothing: every rank keeps every expert")

    @property
    def size(self) -> int:
        """The expert-parallel size it asks for (1 when disabled)."""
        return self.autoep_size if self.enabled else 1


@dataclass
class PipelineConfig:
    """DeepSpeed's "pipeline" section. The PipelineModule decides the stages ("auto" takes its
    num_stages) and the partition; zerotron adds the schedule."""

    stages: int = 1
    schedule: str = "1f1b"  # "gpipe", "1f1b", "interleaved" (1F1B over the module's virtual stages), "zb-h1"
    partition: str = "best"  # accepted for DeepSpeed configs; PipelineModule(partition_method=...) decides
    seed_layers: bool = False
    activation_checkpoint_interval: int = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True

    def validate(self, p: str):
        check(self.stages >= 1, p + ".stages", self.stages, 'use a positive integer (or "auto")')
        check(self.schedule in SCHEDULES, p + ".schedule", self.schedule, f"use one of {', '.join(SCHEDULES)}")


@dataclass
class ActivationCheckpointingConfig:
    """DeepSpeed's "activation_checkpointing" section (for zerotron.checkpointing.checkpoint)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False  # accepted; torch's allocator already reuses the memory
    number_checkpoints: Optional[int] = None  # accepted; the policy decides what is checkpointed
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


TAG_VALIDATION = ("IGNORE", "WARN", "FAIL")  # checkpoint.tag_validation, any case (engine save_checkpoint applies it)
# checkpoint keys DeepSpeed reads that change nothing here, and why (named in a warning when set)
_CHECKPOINT_NOT_NEEDED = {
    "load_universal": "zerotron's load_checkpoint reshards its own checkpoints to any layout without it",
    "use_node_local_storage": "every rank writes its files under save_dir, which must be shared by the nodes",
    "parallel_write": "zerotron writes each rank's files itself (no pipeline-stage writers)",
    "writer": "zerotron writes with torch and safetensors (no DeepSpeed checkpoint writer)",
}


@dataclass
class CheckpointConfig:
    """DeepSpeed's "checkpoint" section. `tag_validation`: save_checkpoint compares the tag across ranks first
    (Ignore: no check; Warn: a warning when they differ; Fail: an error), DeepSpeed's default Warn."""

    tag_validation: str = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: dict = field(default_factory=dict)
    writer: Optional[dict] = None
    checkpoint_serialization: bool = True  # torch.save's zip format (no_effect.ONLY_AT_DEFAULT)

    @property
    def tag_validation_mode(self) -> str:
        return self.tag_validation.upper()

    def validate(self, p: str):
        check(
            self.tag_validation_mode in TAG_VALIDATION,
            p + ".tag_validation",
            self.tag_validation,
            "use Ignore, Warn or Fail (whether save_checkpoint checks that every rank got the same tag)",
        )
        for key, why in _CHECKPOINT_NOT_NEEDED.items():
            if getattr(self, key):
                warn(f"{p}.{key} is ignored: {why}")


@dataclass
class ZerotronConfig:
    """Settings zerotron adds to DeepSpeed's schema, in their own "zerotron" section."""

    sequence_parallel: bool = False
    context_parallel_size: int = 1  # ring attention: each sequence's tokens over this many ranks (x Ulysses')
    check_tensor_parallel_plan: bool = True  # run a few tokens through the model split and unsplit first
    checkpoint_policy: str = (
        "none"  # activation checkpointing the engine applies: none, every_block, every_k, selective
    )
    checkpoint_every: int = 2  # with every_k: checkpoint one block in this many
    # Fault tolerance (zerotron/watchdog.py, engine/step.py):
    collective_timeout: Optional[float] = (
        None  # seconds a collective may wait (None: $ZEROTRON_COLLECTIVE_TIMEOUT or 600)
    )
    collective_checks: bool = False  # debug: compare each collective's op/shape/dtype across ranks first
    max_nonfinite_steps: int = 8  # bf16/fp32: stop after this many consecutive steps with NaN/Inf gradients
    save_on_preemption: Optional[str] = None  # SIGTERM/SIGINT: finish the step, checkpoint here, exit 75

    def validate(self, p: str):
        check(
            self.checkpoint_policy in CHECKPOINT_POLICIES,
            p + ".checkpoint_policy",
            self.checkpoint_policy,
            f"use one of {', '.join(CHECKPOINT_POLICIES)}",
        )
        check(self.checkpoint_every >= 1, p + ".checkpoint_every", self.checkpoint_every, "use a positive integer")
        check(
            self.collective_timeout is None or self.collective_timeout > 0,
            p + ".collective_timeout",
            self.collective_timeout,
            "use a positive number of seconds",
        )
        check(
            self.max_nonfinite_steps >= 1,
            p + ".max_nonfinite_steps",
            self.max_nonfinite_steps,
            "use a positive integer",
        )


def check(ok: bool, key: str, value, fix: str):
    if not ok:
        raise ConfigError(key, value, fix)
