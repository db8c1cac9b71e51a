"""DeepSpeed keys that change nothing in zerotron, each with why: the one list of them (the config
accepts them without a word; tools/config_survey.py counts them as reviewed, not as silently ignored).
Keys that ask for something zerotron does not do are not here: deepspeed.py warns about those, or refuses them."""

# DeepSpeed keys accepted without a word because they change nothing here, by section ("" is the top
# level), each with why. (Keys that ask for something zerotron does not do are warned about in deepspeed.py.)
ACCEPTED_NO_EFFECT = {
    "": {
        "prescale_gradients",  # where DeepSpeed divides by the ranks (before or after the sum): the same mean
        "gradient_predivide_factor",  # likewise: a split of the same division
        "sparse_gradients",  # sparse embedding gradients reduced as sparse tensors: the same values
        "log_level",  # applied to zerotron's logger by initialize() (checked in deepspeed.py)
        "timers",  # DeepSpeed's throughput-timer synchronization: timing only
        "use_data_before_expert_parallelism",  # the order DeepSpeed creates its groups in: the same groups' math
        "disable_python_gc",  # DeepSpeed's garbage-collection pacing: speed only
        "vocabulary_size",  # DeepSpeed only checks its tensor-core alignment (a warning)
    },
    # DeepSpeed computes the norm for its own logging; its flat buffers' alignment
    "zero_optimization": {"compute_grad_norm", "parameter_alignment"},
    # threads DeepSpeed's CPU Adam may use (zerotron's uses torch's)
    "zero_optimization.offload_optimizer": {"cpuadam_cores_perc"},
    # which torch.utils.checkpoint DeepSpeed's pipeline uses for activation_checkpoint_interval
    "pipeline": {"use_reentrant"},
}

# Keys zerotron parses into its typed sections (so engine.config reads them back as DeepSpeed's does) that
# change nothing here: how DeepSpeed schedules, buffers or lays out work that zerotron does its own way.
PARSED_NO_EFFECT = {
    "data_parallel_size": "checked against what the world and the other sizes leave (config/core.py), which decide",
    "zero_optimization.contiguous_gradients": "zerotron's gradients always live in flat contiguous buckets",
    "zero_optimization.overlap_comm": "zerotron always reduces buckets while backward runs",
    "zero_optimization.allgather_partitions": "stages 1-2 always gather the updated shards with one all-gather each",
    "zero_optimization.round_robin_gradients": "the order DeepSpeed assigns gradients to ranks (speed only)",
    "zero_optimization.elastic_checkpoint": "zerotron's checkpoints load at any layout",
    "expert_parallel.preset_model": "zerotron finds a model's experts by their class",
    "pipeline.seed_layers": "PipelineModule(seed_layers=...) decides, as in DeepSpeed",
    "pipeline.pipe_partitioned": "how DeepSpeed splits activations sent between stages over tensor ranks (memory)",
    "pipeline.grad_partitioned": "likewise for the gradients sent back",
    "wandb.team": "read only when wandb is enabled, which zerotron refuses",
    **{
        f"zero_optimization.{section}.{key}": "DeepSpeed's NVMe and pinned-buffer tuning (NVMe offload is refused)"
        for section in ("offload_optimizer", "offload_param")
        for key in (
            "nvme_path",
            "buffer_count",
            "buffer_size",
            "max_in_cpu",
            "fast_init",
            "pipeline_read",
            "pipeline_write",
        )
    },
    **{
        f"zero_optimization.{section}.ratio": "the share DeepSpeed offloads; zerotron offloads the whole (memory only)"
        for section in ("offload_optimizer", "offload_param")
    },
}

MODEL_DTYPE = object()  # (below: the name of the dtype the model trains in, fp32, fp16 or bf16)
# DeepSpeed keys that change nothing at one value (what zerotron does) and are warned about at others:
# key -> (that value, or MODEL_DTYPE: the training dtype's name; what zerotron does instead)
ONLY_AT = {
    "memory_breakdown": (
        False,
        "DeepSpeed's memory printouts around each pass: zerotron logs the model states' memory after the first "
        "step; call engine.memory_report() for more",
    ),
    "dump_state": (False, "printing the engine's state at start: print(engine.config) yourself"),
    "dataloader_drop_last": (
        True,
        "the engine's own DataLoader (initialize(training_data=...)) drops the last partial batch; to keep it, "
        "build your DataLoader yourself",
    ),
    "gradient_accumulation_dtype": (
        MODEL_DTYPE,
        "gradients accumulate in the model dtype (the optimizer's master weights are fp32), remove the key",
    ),
    "seq_parallel_communication_data_type": (
        MODEL_DTYPE,
        "sequence-parallel all-to-alls move activations in the model dtype, remove the key",
    ),
}
# Keys inside sections zerotron parses, warned about at any value but their default (they stay parsed):
ONLY_AT_DEFAULT = {
    "fp16.auto_cast": (False, "casting the inputs to fp16: feed the model fp16 inputs yourself"),
    "zero_optimization.load_from_fp32_weights": (
        True,
        "rebuilding fp32 master weights from the 16-bit ones on load: zerotron loads the saved fp32 masters",
    ),
    "checkpoint.checkpoint_serialization": (True, "torch.save's legacy (non-zip) format: zerotron writes the zip one"),
}
