"""Where DeepSpeed's module paths live in zerotron: the one table the import alias reads.

`PATHS` maps a DeepSpeed module path, relative to the package (`"runtime.zero.partition_parameters"`
for `deepspeed.runtime.zero.partition_parameters`), to the zerotron module that *is* that module
under the alias. A path not in the table maps to the same place below its parent's module:
`"runtime.foo"` -> `resolve("runtime") + ".foo"`, and a top-level `"foo"` -> `"zerotron.foo"` -- so
`deepspeed.zero` is `zerotron.zero` without an entry. Entries that say what the rule would say
anyway are listed on purpose: the table is also the list of paths the tests import.

Several DeepSpeed modules may map onto one zerotron module (`ops.adam.fused_adam` and
`ops.adam.cpu_adam` are both `zerotron.ops.adam`). Targets are real module names, never other
aliases. Stdlib only: read when zerotron is imported (and by the start-up hook's resolver).

`NAMES` are DeepSpeed's top-level names (`deepspeed.get_accelerator`, `deepspeed.DeepSpeedEngine`,
...) that zerotron's package serves on first access (PEP 562), as (module path, attribute).
"""

from __future__ import annotations

PATHS: dict[str, str] = {
    # accelerator: one module holds DeepSpeed's whole accelerator package
    "accelerator": "zerotron.compat.accelerator",
    "accelerator.real_accelerator": "zerotron.compat.accelerator",
    "accelerator.abstract_accelerator": "zerotron.compat.accelerator",
    # comm: zerotron.comm is DeepSpeed's functions (comm/api.py) plus zerotron's Comm
    "comm": "zerotron.comm",
    "comm.comm": "zerotron.comm.api",
    # utils
    "utils": "zerotron.compat.utils",
    "utils.groups": "zerotron.compat.utils.groups",
    "utils.zero_to_fp32": "zerotron.compat.utils.zero_to_fp32",
    "utils.module_utils": "zerotron.compat.utils.module_utils",
    "utils.torch": "zerotron.compat.utils.torch_version",
    # what this installation is (version, ops, torch's versions)
    "git_version_info": "zerotron.compat.git_version_info",
    # compression: DeepSpeed removed the library and kept helper's two functions (DeepSpeed-Chat imports them)
    "compression": "zerotron.compat.utils.module_utils",
    "compression.helper": "zerotron.compat.utils.module_utils",
    # runtime
    "runtime": "zerotron.compat.runtime",
    "runtime.engine": "zerotron.compat.runtime.engine",
    "runtime.utils": "zerotron.compat.runtime.utils",
    "runtime.config": "zerotron.compat.runtime.config",
    "runtime.constants": "zerotron.compat.runtime.constants",
    "runtime.dataloader": "zerotron.compat.runtime.dataloader",
    "runtime.lr_schedules": "zerotron.compat.runtime.lr_schedules",
    "runtime.zero": "zerotron.compat.runtime.zero",
    "runtime.zero.partition_parameters": "zerotron.compat.runtime.zero.partition_parameters",
    "runtime.zero.config": "zerotron.compat.runtime.zero.config",
    "runtime.zero.offload_config": "zerotron.compat.runtime.zero.offload_config",
    "runtime.fp16.fused_optimizer": "zerotron.compat.runtime.fp16.fused_optimizer",
    "runtime.fp16.unfused_optimizer": "zerotron.compat.runtime.fp16.unfused_optimizer",
    "runtime.bf16_optimizer": "zerotron.compat.runtime.bf16_optimizer",
    "runtime.zero.utils": "zerotron.compat.runtime.zero.utils",
    "runtime.precision_config": "zerotron.compat.runtime.precision_config",
    "runtime.activation_checkpointing": "zerotron.compat.runtime.activation_checkpointing",
    "runtime.activation_checkpointing.checkpointing": "zerotron.activation_checkpointing",  # as deepspeed.checkpointing
    "runtime.pipe": "zerotron.compat.runtime.pipe",
    "runtime.pipe.module": "zerotron.compat.runtime.pipe.module",
    "runtime.pipe.engine": "zerotron.compat.runtime.pipe.engine",
    "runtime.pipe.topology": "zerotron.compat.runtime.pipe.topology",
    "runtime.tensor_parallel": "zerotron.compat.tensor_parallel",
    # sequence_parallel: ALST (Ulysses for Hugging Face models) and the sequence-parallel mpu
    "runtime.sequence_parallel": "zerotron.compat.sequence_parallel",
    "runtime.sequence_parallel.ulysses_sp": "zerotron.compat.sequence_parallel",
    "runtime.sequence_parallel.parallel_state_sp": "zerotron.long_context.mpu",
    # sequence: DeepSpeed-Ulysses' DistributedAttention
    "sequence": "zerotron.long_context",
    "sequence.layer": "zerotron.long_context.ulysses",
    # checkpoint is zerotron's own package; DeepSpeed's helpers below it live in compat
    "checkpoint.utils": "zerotron.compat.checkpoint_utils",
    # launcher: constants only (launch with torchrun / zerotron run)
    "launcher": "zerotron.compat.launcher",
    "launcher.runner": "zerotron.compat.launcher",
    # profiling: DeepSpeed's flops_profiler package is one module here (zerotron/profiling/flops.py)
    "profiling.flops_profiler": "zerotron.profiling.flops",
    "profiling.flops_profiler.profiler": "zerotron.profiling.flops",
    # moe: zerotron's own package (its gating and layer); DeepSpeed's helpers beside them live in compat
    "moe": "zerotron.moe",
    "moe.utils": "zerotron.compat.moe.utils",
    "moe.layer": "zerotron.moe.layer",
    "moe.sharded_moe": "zerotron.compat.moe.sharded_moe",
    "moe.experts": "zerotron.compat.moe.experts",
    # zerotron's core, where DeepSpeed has the same top-level names
    "zero": "zerotron.zero",
    "pipe": "zerotron.pipe",
    "checkpointing": "zerotron.activation_checkpointing",
    # ops: DeepSpeed's packages of one optimizer each are one module each in zerotron
    "ops": "zerotron.ops",
    "ops.adam": "zerotron.ops.adam",
    "ops.adam.fused_adam": "zerotron.ops.adam",
    "ops.adam.cpu_adam": "zerotron.ops.adam",
    "ops.adagrad": "zerotron.ops.adagrad",
    "ops.adagrad.cpu_adagrad": "zerotron.ops.adagrad",
    "ops.lion": "zerotron.ops.lion",
    "ops.lion.cpu_lion": "zerotron.ops.lion",
    "ops.lion.fused_lion": "zerotron.ops.lion",
    "ops.lamb": "zerotron.ops.lamb",
    "ops.lamb.fused_lamb": "zerotron.ops.lamb",
    # which of DeepSpeed's ops exist (the Python optimizers above); nothing is compiled
    "ops.op_builder": "zerotron.compat.op_builder",
    "ops.aio": "zerotron.compat.op_builder",  # (DeepSpeed's NVMe I/O package: its AsyncIOBuilder, not compatible)
    "ops.transformer": "zerotron.compat.transformer_kernel",  # (DeepSpeed's fused CUDA layer: importable, refused)
    "inference": "zerotron.compat.inference",  # (DeepSpeed-Inference: init_inference importable, refused)
}

# DeepSpeed packages of features zerotron does not implement: path -> what it is and what to do instead. Importing
# one (or anything below it) either way in raises ModuleNotFoundError with that text, not a bare missing name.
NOT_SERVED: dict[str, str] = {
    "runtime.data_pipeline": "DeepSpeed's data efficiency library (curriculum learning, data analysis and sampling, "
    "variable batch size and LR, random-LTD routing): order, sample and batch the data in your own DataLoader and "
    "scale the learning rate with a torch scheduler",
    "runtime.domino": "DeepSpeed-Domino's Megatron tensor-parallel layers (CUDA overlap of compute and "
    "communication): use tensor_parallel.autotp_size on the model's own layers",
    "module_inject": "DeepSpeed's inference kernel injection (init_inference and its policies): run the trained "
    "model's own forward, or an inference engine",
}

# DeepSpeed's top-level names: name -> (DeepSpeed module path, attribute there).
NAMES: dict[str, tuple[str, str]] = {
    "get_accelerator": ("accelerator", "get_accelerator"),
    "DeepSpeedEngine": ("runtime.engine", "DeepSpeedEngine"),
    "PipelineEngine": ("runtime.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("pipe", "PipelineModule"),
    "DeepSpeedConfig": ("runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("runtime.config", "DeepSpeedConfigError"),
    "DeepSpeedDataLoader": ("runtime.dataloader", "DeepSpeedDataLoader"),
    "log_dist": ("utils", "log_dist"),
    "logger": ("utils", "logger"),
    "OnDevice": ("utils", "OnDevice"),
    "tp_model_init": ("runtime.tensor_parallel", "tp_model_init"),
    "DeepSpeedTransformerLayer": ("ops.transformer", "DeepSpeedTransformerLayer"),
    "DeepSpeedTransformerConfig": ("ops.transformer", "DeepSpeedTransformerConfig"),
    "init_inference": ("inference", "init_inference"),
}


def resolve(path: str) -> str:
    """The zerotron module name for a DeepSpeed module path relative to the package ("" is the
    package itself)."""
    if not path:
        return "zerotron"
    if path in PATHS:
        return PATHS[path]
    parent, _, last = path.rpartition(".")
    return f"{resolve(parent)}.{last}"


def not_served(path: str) -> str | None:
    """Why `path` (relative to the package) is not served, when it is in or below a NOT_SERVED package."""
    for top, why in NOT_SERVED.items():
        if path == top or path.startswith(top + "."):
            return f"zerotron does not implement {why}"
    return None


def children(module_name: str) -> dict[str, str]:
    """{attribute: target module} for the table's paths one level below a path that resolves to
    `module_name`: what `<that module>.<attribute>` is under the alias."""
    out = {}
    for path, target in PATHS.items():
        parent, _, last = path.rpartition(".")
        if resolve(parent) == module_name:
            out[last] = target
    return out
