"""Config keys: a misspelt or unknown key is an error naming the nearest one, an unknown section warns,
and every key DeepSpeed accepts in a section zerotron knows is accepted.

Pure Python: no process groups.
"""

import warnings

import pytest
from config_helpers import load, triple, zerotron_warnings

from zerotron.config import Config
from zerotron.errors import ConfigError


# Inside a section zerotron knows, an unknown key is an error naming the nearest key (DeepSpeed's
# config models refuse unknown fields too); at the top level, a near miss of a key is an error, and a
# section that is neither DeepSpeed's nor zerotron's is a warning.
@pytest.mark.parametrize(
    "extra,key,near",
    [
        ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "stage"),
        ({"fp16": {"enabled": False, "loss_scal": 0}}, "fp16.loss_scal", "loss_scale"),
        ({"optimizer": {"type": "AdamW", "parms": {}}}, "optimizer.parms", "params"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "none", "devise": "cpu"}}},
            "zero_optimization.offload_optimizer.devise",
            "device",
        ),
        ({"zerotron": {"checkpoint_polcy": "none"}}, "zerotron.checkpoint_polcy", "checkpoint_policy"),
        ({"pipeline": {"stage": 1}}, "pipeline.stage", "stages"),
        ({"train_micro_batch_size_per_gpus": 4}, "train_micro_batch_size_per_gpus", "train_micro_batch_size_per_gpu"),
        ({"train_batchsize": 4}, "train_batchsize", "train_batch_size"),
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
        ({"gradient_acumulation_steps": 2}, "gradient_acumulation_steps", "gradient_accumulation_steps"),
    ],
)
def test_a_misspelt_key_is_an_error_that_names_the_nearest_key(extra, key, near):
    with pytest.raises(ConfigError) as info:
        load(extra)
    assert info.value.key == key
    assert f"did you mean '{near}'?" in str(info.value)


def test_an_unknown_key_with_no_near_miss_lists_the_section_keys():
    with pytest.raises(ConfigError) as info:
        load({"bf16": {"enabled": True, "xyzzy": 1}})
    assert info.value.key == "bf16.xyzzy" and "its keys: enabled" in str(info.value)


def test_an_unknown_top_level_section_warns_with_its_name():
    with pytest.warns(UserWarning, match=r"neither DeepSpeed's nor zerotron's: my_own_settings") as record:
        cfg = Config.load({"train_batch_size": 8, "my_own_settings": {"a": 1}})
    assert triple(cfg) == (8, 8, 1)
    assert len(zerotron_warnings(record)) == 1
    assert record[0].filename == __file__  # the warning points at the caller's line, not at zerotron


def test_every_key_deepspeed_accepts_in_a_section_zerotron_knows_is_accepted():
    """DeepSpeed 0.19.8's fields of the sections zerotron parses (read off its pydantic models and
    its pipeline/activation-checkpointing dicts): none is refused as a typo."""
    zero = [
        "allgather_bucket_size",
        "allgather_partitions",
        "allgather_sequential",
        "compute_grad_norm",
        "contiguous_gradients",
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
        "elastic_checkpoint",
        "enable_sanity_checks",
        "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters",
        "leaf_module",
        "legacy_stage1",
        "load_from_fp32_weights",
        "log_trace_cache_warnings",
        "max_live_parameters",
        "max_reuse_distance",
        "memory_efficient_linear",
        "model_persistence_threshold",
        "module_granularity_threshold",
        "overlap_comm",
        "override_module_apply",
        "param_persistence_threshold",
        "parameter_alignment",
        "pipeline_loading_checkpoint",
        "prefetch_bucket_size",
        "reduce_bucket_size",
        "reduce_scatter",
        "round_robin_gradients",
        "save_muon_momentum_buffer_in_memory",
        "stage",
        "stage3_allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold",
        "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size",
        "stage3_use_all_reduce_for_fetch_params",
        "sub_group_size",
        "use_all_reduce_for_fetch_params",
        "use_multi_rank_bucket_allreduce",
        "zenflow",
        "zero_hpz_partition_size",
        "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_weights",
    ]
    sections = {
        "fp16": [
            "auto_cast",
            "consecutive_hysteresis",
            "enabled",
            "fp16_master_weights_and_grads",
            "hysteresis",
            "initial_scale_power",
            "loss_scale",
            "loss_scale_window",
            "min_loss_scale",
        ],
        "bf16": [
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
            "check_grad_overflow",
            "enabled",
            "immediate_grad_update",
        ],
        "tensorboard": ["enabled", "job_name", "output_path"],
        "csv_monitor": ["enabled", "job_name", "output_path"],
        "wandb": ["enabled", "group", "project", "team"],
        "tensor_parallel": [
            "autotp_size",
            "dtype",
            "injection_policy_tuple",
            "keep_module_on_host",
            "kernel_inject",
            "partition_config",
            "preset_model",
            "replace_with_kernel_inject",
            "tensor_parallel",
            "tp",
            "tp_overlap_comm",
            "vocab_parallel_ce_backend",
            "vocab_parallel_lm_head",
        ],
        "pipeline": [
            "stages",
            "partition",
            "seed_layers",
            "activation_checkpoint_interval",
            "pipe_partitioned",
            "grad_partitioned",
            "use_reentrant",
        ],
        "activation_checkpointing": [
            "partition_activations",
            "number_checkpoints",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
            "cpu_checkpointing",
        ],
        "optimizer": ["type", "params", "legacy_fusion"],
        "scheduler": ["type", "params"],
    }
    offload_param = ["buffer_count", "buffer_size", "device", "max_in_cpu", "nvme_path", "pin_memory"]
    offload_optimizer = [
        "buffer_count",
        "cpuadam_cores_perc",
        "device",
        "fast_init",
        "nvme_path",
        "pin_memory",
        "pipeline_read",
        "pipeline_write",
        "ratio",
        "super_offload",
    ]
    values = {
        "enabled": False,
        "device": "none",
        "stage": 0,
        "type": "AdamW",
        "params": {},
        "stages": 1,
        "tensor_parallel": {},
        "tp": {},
        "zenflow": {},
        "autotp_size": 1,
        "pipeline": {},
    }

    def section(keys):
        return {k: values.get(k, None if k.endswith(("_path", "dtype")) else 1) for k in keys}

    raw = {name: section(keys) for name, keys in sections.items()}
    for key in zero:  # one at a time: some are aliases of others
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load({"zero_optimization": {key: values.get(key, 1)}})
            except ConfigError as e:
                assert "has no key" not in str(e), e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, keys in raw.items():
            try:
                load({name: keys})
            except ConfigError as e:
                assert "has no key" not in str(e), e
        for name, keys in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
            try:
                load({"zero_optimization": {"stage": 3, name: section(keys)}})
            except ConfigError as e:
                assert "has no key" not in str(e), e


def test_known_no_effect_deepspeed_keys_do_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = Config.load(
            {
                "train_batch_size": 8,
                "wall_clock_breakdown": False,
                "memory_breakdown": False,
                "zero_allow_untested_optimizer": True,
                "prescale_gradients": False,
                "flops_profiler": {"enabled": False, "profile_step": 1},
                "comms_logger": {"enabled": False},
                "dump_state": False,
                "steps_per_print": 100,
            }
        )
    assert zerotron_warnings(record) == []
    assert cfg.raw["wall_clock_breakdown"] is False  # kept in the raw dict


def test_a_clean_config_does_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load({"fp16": {"enabled": True, "loss_scale": 0}, "zero_optimization": {"stage": 0}})
    assert zerotron_warnings(record) == []
