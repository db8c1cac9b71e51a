"""DeepSpeed's config keys under other names, and its features zerotron does not implement:
plain tables and the two passes `Config.load` makes over the raw JSON before parsing it
(renaming DeepSpeed's aliases and deprecated keys; warning about, or refusing, features)."""

from __future__ import annotations

import copy

from ..errors import ConfigError
from ..log import warn
from .no_effect import MODEL_DTYPE, ONLY_AT, ONLY_AT_DEFAULT
from .sections import as_bool
from .sections import enabled as _enabled

# DeepSpeed features zerotron does not implement whose keys can be ignored without training a
# different model than asked (they change speed, memory or tooling, or the script must call
# DeepSpeed's own API for them, which then fails by name): accepted with a warning naming each.
_NOT_IMPLEMENTED = {
    "compile": "DeepSpeed's compile/deepcompile: torch.compile the model yourself",
    "compression_training": "model compression (quantization, pruning, layer reduction): compress the model with a "
    "library of its own after training",
    "data_efficiency": "data efficiency (curriculum data sampling, random-LTD): order and sample the data in your "
    "own DataLoader",
    "quantize_training": "MoQ quantization during training: train in bf16 and quantize the trained model",
    "eigenvalue": "eigenvalue-based MoQ: remove the section",
    "sparse_attention": "sparse attention layouts: use the model's own (dense) attention",
    "hybrid_engine": "the RLHF hybrid engine's inference kernels: the engine trains as usual, syncs the ranks' RNG "
    "from rank 0 as DeepSpeed's does, and module.generate() runs the training model itself, which is what DeepSpeed "
    "does for a model it has no kernel for (Transformers 4.57's OPT on CPU: the same tokens); max_out_tokens, "
    "inference_tp_size, release_inference_cache, pin_parameters, tp_gather_partition_size and enable_cuda_graph "
    "tune those kernels and change nothing here: nothing to do",
    "weight_quantization": "quantized weights: quantize the trained model",
    "nebula": "Nebula checkpointing: engine.save_checkpoint writes to save_dir",
    "datastates": "DataStates checkpointing: engine.save_checkpoint writes to save_dir",
    "aio": "async I/O for NVMe offload: zerotron offloads to host memory (offload device 'cpu')",
    "graph_harvesting": "CUDA graph harvesting: remove the key",
    "disable_allgather": "disable_allgather (a legacy switch): remove the key",
    "torch_autocast": "torch.autocast around the forward: the forward runs in the model's dtype, for bf16 training "
    'set "bf16": {"enabled": true}',
    "amp": "apex AMP: the model runs in its dtype, use the 'fp16' or 'bf16' section",
    "data_types": "data_types: gradients accumulate in the model dtype and the optimizer sees fp32: remove the section",
    "comet": "Comet logging: use 'tensorboard' or 'csv_monitor'",
    "datastates_ckpt": "DataStates checkpointing: engine.save_checkpoint writes to save_dir",
}
_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _model_dtype(raw: dict) -> str:
    return (
        "bf16"
        if _enabled(raw.get("bf16")) or _enabled(raw.get("bfloat16"))
        else "fp16"
        if _enabled(raw.get("fp16"))
        else "fp32"
    )


_NOT_IMPLEMENTED_IN = {
    "zero_optimization": {
        k: "ZeRO++ / MiCS and other DeepSpeed ZeRO options: zerotron's ZeRO trains the same model "
        "without them, remove the key"
        for k in (
            "model_persistence_threshold",
            "stage3_model_persistence_threshold",
            "module_granularity_threshold",
            "stage3_module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "stage3_use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "stage3_allgather_sequential",
            "zero_hpz_partition_size",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
            "zeropp_loco_param",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
            "leaf_module",
            "use_multi_rank_bucket_allreduce",
            "legacy_stage1",
        )
    }
    | {
        "zenflow": "ZenFlow (applies the smaller gradients late, every update_interval steps: DeepSpeed then trains "
        "another model than without it): zerotron applies every gradient at every step, the update ZenFlow "
        "approximates; remove the section"
    },
    "bf16": {
        "bf16_master_weights_and_grads": "bf16 master weights and gradients: zerotron keeps fp32 ones, remove the key",
        "bf16_optimizer_states": "bf16 optimizer states: zerotron keeps them in fp32, remove the key",
        "immediate_grad_update": "immediate gradient updates: the update runs at the step, remove the key",
        "check_grad_overflow": "bf16 overflow checks: zerotron always checks (max_nonfinite_steps), remove it",
    },
    "fp16": {
        "fp16_master_weights_and_grads": "fp16 master weights and gradients: zerotron keeps fp32 ones, remove the key"
    },
    "optimizer": {"legacy_fusion": "legacy optimizer fusion: remove the key"},
    "zero_optimization.offload_optimizer": {
        "super_offload": "SuperOffload (for superchips): offload to 'cpu' instead, remove the key"
    },
    # AutoEP's description of the model to its replacement layer (zerotron runs the model's own router
    # and experts, which need none of it) and its kernel and communication options
    "expert_parallel": {
        k: "AutoEP's description of the model and its kernels: zerotron runs the model's own router and experts, "
        "remove the key"
        for k in (
            "expert_tensor_parallel_size",
            "validate_folding_routing",
            "async_split_plan",
            "moe_layer_pattern",
            "expert_pattern",
            "router_pattern",
            "use_grouped_mm",
            "disable_triton_grouped_mm",
            "route_norm",
            "route_scale",
            "score_apply",
            "combine_impl",
            "row_weighting_impl",
            "gate_up_impl",
            "comm_backend",
            "comm_num_sm",
            "comm_qp_margin",
            "comm_max_tokens_per_rank",
            "num_expert_groups",
            "num_limited_groups",
            "score_func",
            "top_k",
            "load_balance_coeff",
            "routed_scaling_factor",
            "expert_w1",
            "expert_w2",
            "expert_w3",
            "num_experts_attr",
            "top_k_attr",
            "has_shared_experts",
            "shared_experts_pattern",
            "shared_experts_gate_pattern",
            "expert_activation",
        )
    },
    # AutoTP's inference and kernel-injection options, and its own partition specs: zerotron splits
    # by the model's plan (parallelize/registry.py), which gives the same math
    "tensor_parallel": {
        k: "AutoTP's inference, kernel-injection and custom partition options: zerotron splits by the model's plan, "
        "remove the key"
        for k in (
            "dtype",
            "injection_policy_tuple",
            "keep_module_on_host",
            "kernel_inject",
            "replace_with_kernel_inject",
            "partition_config",
            "preset_model",
            "tensor_parallel",
            "tp",
            "vocab_parallel_lm_head",
            "vocab_parallel_ce_backend",
        )
    },
}
# Every top-level key DeepSpeed 0.19.8 reads (its DeepSpeedConfig, the optimizer, scheduler,
# profiler and autotuning configs): an unknown top-level key that is one of these is a DeepSpeed
# feature zerotron ignores (a warning); one that is none of these but close to a key is a typo (an error).
DEEPSPEED_TOP_LEVEL = frozenset(
    {
        "activation_checkpointing",
        "aio",
        "amp",
        "autotuning",
        "bf16",
        "bfloat16",
        "checkpoint",
        "comet",
        "comms_logger",
        "communication_data_type",
        "compile",
        "compression_training",
        "csv_monitor",
        "curriculum_learning",
        "data_efficiency",
        "data_types",
        "dataloader_drop_last",
        "datastates_ckpt",
        "disable_allgather",
        "disable_python_gc",
        "dump_state",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "flops_profiler",
        "fp16",
        "gradient_accumulation_dtype",
        "gradient_accumulation_steps",
        "gradient_allreduce_op",
        "gradient_clipping",
        "gradient_predivide_factor",
        "graph_harvesting",
        "hybrid_engine",
        "log_level",
        "managed_gradient_accumulation",
        "memory_breakdown",
        "nebula",
        "optimizer",
        "pipeline",
        "prescale_gradients",
        "progressive_layer_drop",
        "quantize_training",
        "scheduler",
        "seq_parallel_communication_data_type",
        "sequence_parallel_size",
        "sparse_attention",
        "sparse_gradients",
        "steps_per_print",
        "tensor_parallel",
        "tensorboard",
        "timers",
        "torch_autocast",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "wall_clock_breakdown",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "zero_optimization",
    }
)
# DeepSpeed's other names for zero_optimization keys: (alias, zerotron's key).
_ZERO_ALIASES = [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
    ("param_persistence_threshold", "stage3_param_persistence_threshold"),
    ("max_live_parameters", "stage3_max_live_parameters"),
    ("max_reuse_distance", "stage3_max_reuse_distance"),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
]


# DeepSpeed's deprecated zero_optimization keys (the "deprecated" fields of its DeepSpeedZeroConfig), read as it reads
# them: old key -> (its new key, the new key's value from the old true/false, or None where DeepSpeed sets nothing
# and only warns). Giving an old key beside its new one is an error there and here.
_ZERO_DEPRECATED = {
    "cpu_offload": ("offload_optimizer", lambda on: {"device": "cpu"} if on else None),
    "cpu_offload_param": ("offload_param", lambda on: {"device": "cpu"} if on else None),
    "stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", lambda on: on),
    "cpu_offload_use_pin_memory": ("offload_optimizer.pin_memory or offload_param.pin_memory", None),
}


def deepspeed_names(raw: dict) -> dict:
    """DeepSpeed's aliases and deprecated keys under the names zerotron reads (a copy)."""
    if isinstance(raw.get("zero_optimization"), bool):  # DeepSpeed's oldest format: true is stage 1
        raw = dict(raw)
        on, size = raw.pop("zero_optimization"), raw.pop("allgather_size", 500_000_000)
        raw["zero_optimization"] = {"stage": 1, "allgather_bucket_size": size} if on else {"stage": 0}
        warn('"zero_optimization": true/false is deprecated in DeepSpeed; read as {"stage": 1} (or 0)')
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict):
        return raw
    raw = copy.deepcopy(raw)
    zero = raw["zero_optimization"]
    p = "zero_optimization."
    for alias, key in _ZERO_ALIASES:
        if alias in zero:
            value = zero.pop(alias)
            if key in zero and zero[key] != value:
                raise ConfigError(
                    p + alias, value, f"it is another name for {key}, which is set to {zero[key]!r}; keep one of them"
                )
            zero[key] = value
    for old, (new, convert) in _ZERO_DEPRECATED.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if as_bool(value) is None:
            raise ConfigError(p + old, value, f"expected true or false (it is deprecated: use {p}{new})")
        if convert is None:
            warn(f"{p}{old} is deprecated in DeepSpeed and has no effect there or here; use {p}{new}")
            continue
        if new in zero:
            raise ConfigError(p + old, value, f"it is DeepSpeed's deprecated name for {p}{new}, also set; keep {new}")
        warn(f"{p}{old} is deprecated in DeepSpeed; read as {p}{new} = {convert(as_bool(value))!r}")
        if convert(as_bool(value)) is not None:
            zero[new] = convert(as_bool(value))
    return raw


def deepspeed_features(raw: dict) -> dict:
    """Refuse DeepSpeed features whose absence would train a different model without a word
    (ConfigError: key, value, fix); warn, by name, about the others zerotron does not implement.
    Returns the dict to parse, without the keys warned about here."""
    refusals = [
        (
            "progressive_layer_drop",
            _enabled(raw.get("progressive_layer_drop")),
            "progressive layer drop (DeepSpeed hands pld_theta to the model's forward) is not implemented by zerotron; "
            "set enabled to false or remove the section",
        ),
        (
            "curriculum_learning",
            _enabled(raw.get("curriculum_learning")),
            "curriculum learning (DeepSpeed hands curriculum_seqlen to the model's forward) is not implemented by "
            "zerotron; set enabled to false or remove the section",
        ),
        (
            "elasticity",
            _enabled(raw.get("elasticity")),
            "elastic training (DeepSpeed chooses the batch sizes) is not implemented by zerotron, remove the section "
            "and set train_batch_size / train_micro_batch_size_per_gpu yourself",
        ),
        (
            "gradient_allreduce_op",
            raw.get("gradient_allreduce_op", "mean") != "mean",
            'zerotron averages gradients over the data-parallel ranks; use "mean" (the default)',
        ),
        (
            "managed_gradient_accumulation",
            raw.get("managed_gradient_accumulation", True) is not True,
            "zerotron steps the optimizer at the gradient accumulation boundary only, remove the key or set it to true",
        ),
    ]
    for key, refused, fix in refusals:
        if refused:
            value = raw[key]
            raise ConfigError(
                f"{key}.enabled" if isinstance(value, dict) else key, True if isinstance(value, dict) else value, fix
            )
    out = dict(raw)
    named = []
    for key in list(out):
        if key in _NOT_IMPLEMENTED:
            if not (isinstance(out[key], dict) and out[key].get("enabled", True) is False):  # (disabled: nothing asked)
                named.append(f"{key} ({_NOT_IMPLEMENTED[key]})")
            del out[key]
        elif key == "autotuning":  # initialize() applies an enabled section (zerotron/autotuning): not here
            if _enabled(out[key]):
                named.append(
                    "autotuning (initialize() and `zerotron run --autotuning` apply it, as they see the model, "
                    "not a config read on its own)"
                )
            del out[key]
        elif key in ("progressive_layer_drop", "curriculum_learning", "elasticity"):  # present but disabled
            del out[key]
        elif key in ("gradient_allreduce_op", "managed_gradient_accumulation"):
            del out[key]  # the default values, checked above
    for key, (fine, what) in ONLY_AT.items():
        if key in out:
            value, fine = out.pop(key), _model_dtype(raw) if fine is MODEL_DTYPE else fine
            if _DTYPE_NAMES.get(value, value) != fine:
                named.append(f"{key} = {value!r} ({what})")
    for path, (default, what) in ONLY_AT_DEFAULT.items():
        section, key = _copied_section(out, path.rsplit(".", 1)[0]) or {}, path.rsplit(".", 1)[1]
        if key in section and section[key] != default:
            named.append(f"{path} = {section[key]!r} ({what})")
    if "log_level" in out and str(out["log_level"]).lower() not in _LOG_LEVELS:  # initialize() applies it
        raise ConfigError("log_level", out["log_level"], f"use one of {', '.join(_LOG_LEVELS)}")
    for path, keys in _NOT_IMPLEMENTED_IN.items():
        section = _copied_section(out, path)
        for k in [k for k in (section or {}) if k in keys]:
            named.append(f"{path}.{k} ({keys[k]})")
            del section[k]
    if named:
        warn(
            "zerotron does not implement these DeepSpeed features and ignores their keys (each followed by what "
            "to do instead): " + "; ".join(named)
        )
    return out


def _copied_section(raw: dict, path: str) -> dict | None:
    """The (possibly nested) section at a dotted `path`, copied into `raw` along the way so that
    deleting from it leaves the caller's dict alone; None when absent or not an object."""
    node = raw
    for part in path.split("."):
        if not isinstance(node.get(part), dict):
            return None
        node[part] = dict(node[part])
        node = node[part]
    return node
