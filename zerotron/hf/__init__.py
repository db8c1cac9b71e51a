"""Hugging Face Transformers models under zerotron.

    model = AutoModelForCausalLM.from_config(cfg)          # or from_pretrained / load_hf_weights
    engine, *_ = zerotron.initialize(model=model, config=zerotron.hf.resolve_config("ds.json", training_args, model))

ZeRO 1-3, offload and activation checkpointing need nothing model-specific. Tensor parallelism
takes the plan Transformers ships with the model, translated to zerotron's styles, and pipelines
cut the model into stages: both in zerotron/parallelize/ (hf.py, hf_pipeline.py), beside GPT's.
Here: Trainer-style configs, weights in and out (io.py), and generation under ZeRO-3 that keeps
every rank in every forward (`generate` below).
"""

from __future__ import annotations

import torch

from ..parallelize.hf import is_hf_model, tensor_parallel_plan  # noqa: F401 (zerotron.hf's names, kept)
from ..parallelize.hf_pipeline import to_pipeline  # noqa: F401
from .io import load_hf_weights, save_hf_pretrained  # noqa: F401


def resolve_config(config, training_args=None, model=None, **values):
    """A DeepSpeed config with "auto" values filled the way the Transformers Trainer fills them,
    from `training_args` (a TrainingArguments or any object with its attribute names), the model
    (hidden size, dtype) and explicit `values` (which win). Returns a dict for zerotron.initialize."""
    from ..config import read_raw, resolve_auto

    args = training_args
    found = {}
    if args is not None:
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        found.update(
            micro_batch_size=get("per_device_train_batch_size"),
            gradient_accumulation_steps=get("gradient_accumulation_steps"),
            lr=get("learning_rate"),
            eps=get("adam_epsilon"),
            weight_decay=get("weight_decay"),
            max_grad_norm=get("max_grad_norm"),
            fp16=get("fp16"),
            bf16=get("bf16"),
            warmup_steps=get("warmup_steps"),
            total_steps=get("max_steps") if (get("max_steps") or 0) > 0 else None,
        )
        if get("adam_beta1") is not None and get("adam_beta2") is not None:
            found["betas"] = [get("adam_beta1"), get("adam_beta2")]
        if found.get("warmup_steps") in (None, 0) and get("warmup_ratio") and found.get("total_steps"):
            found["warmup_steps"] = int(get("warmup_ratio") * found["total_steps"])
    if model is not None:
        hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "n_embd", None)
        found["hidden_size"] = hidden
    found.update(values)
    return resolve_auto(read_raw(config), **{k: v for k, v in found.items() if v is not None})


@torch.no_grad()
def generate(engine, input_ids, **kwargs):
    """`model.generate` on every rank. Under ZeRO-3 each forward gathers parameters with
    collectives, so a rank that finishes early must keep stepping until all have finished
    (Transformers' synced_gpus)."""
    import torch.distributed as dist

    synced = engine.zero_optimization_stage() == 3 and dist.get_world_size() > 1
    was_training = engine.module.training
    engine.module.eval()
    try:
        return engine.module.generate(input_ids.to(engine.device), synced_gpus=synced, **kwargs)
    finally:
        engine.module.train(was_training)
