"""What the tuner needs to know about the model: its shape as the planner sees it, and the sequence length.

The shape comes from the model's own config (a Hugging Face model's, or zerotron's GPT), else from the
autotuning section's `model_info` (DeepSpeed's keys: num_params, hidden_size, num_layers). The launcher's
probe run records both at the script's first forward (`install_probe`) and stops the job there.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..config.sections import enabled
from ..errors import ConfigError
from ..log import logger
from ..planner.model import ModelShape

HF_LOSS_COPIES = 2  # Transformers' causal-LM loss: the shifted logits and the log-softmax (ModelShape.loss_copies)
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def model_shape(model, info: dict | None) -> ModelShape:
    """The planner's view of `model` (see the module's docstring)."""
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "n_kv_head") and hasattr(cfg, "d_model"):  # zerotron's GPTConfig
        return ModelShape.of_gpt(cfg)
    if hasattr(cfg, "to_dict"):  # a Transformers PretrainedConfig
        try:
            return replace(ModelShape.from_hf_config(cfg.to_dict()), loss_copies=HF_LOSS_COPIES)
        except ValueError:
            pass  # an encoder or an unusual config: model_info may still describe it
    if info and all(info.get(k) for k in ("num_params", "hidden_size", "num_layers")):
        return _from_model_info(info)
    raise ConfigError(
        "autotuning",
        "enabled",
        "the planner predicts from the model's shape, and this model has no Hugging Face or zerotron config to read "
        'it from; describe it in the section: "model_info": {"num_params": N, "hidden_size": H, "num_layers": L}, '
        "or set train_micro_batch_size_per_gpu yourself",
    )


def _from_model_info(info: dict) -> ModelShape:
    """A GPT-style shape with DeepSpeed's three numbers: 12·h² parameters per layer, the rest an embedding."""
    n, h, layers = int(info["num_params"]), int(info["hidden_size"]), int(info["num_layers"])
    heads = max(1, h // 64) if h % 64 == 0 else 1
    vocab = max(1, (n - 12 * layers * h * h) // h)
    return ModelShape(layers, h, heads, heads, 4 * h, vocab, tied=True, gated=False)


def max_positions(model) -> int | None:
    """The longest sequence the model takes, from its config (None when it says nothing)."""
    cfg = getattr(model, "config", None)
    for key in _MAX_POSITIONS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def dtype_of(raw: dict, model) -> str:
    for key in ("bf16", "bfloat16", "fp16"):
        if enabled(raw.get(key)):
            return "fp16" if key == "fp16" else "bf16"
    dtypes = {p.dtype for p in model.parameters()}
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(next(iter(dtypes), torch.float32), "fp32")


def _sequence_length(args, kwargs) -> int | None:
    """The tokens per sequence of a forward's inputs: input_ids' (or the first 2-d tensor's) last dimension."""
    found = kwargs.get("input_ids")
    if not isinstance(found, torch.Tensor):
        found = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    return int(found.shape[1]) if found is not None else None


def install_probe(model, raw: dict, path: str, world_size: int):
    """The launcher's probe: at the model's first forward, write what the tuner needs to `path` (rank 0) and end
    the process with status 0 before any collective of the step runs (every rank stops at the same point)."""
    shape = model_shape(model, (raw.get("autotuning") or {}).get("model_info"))
    info = {
        "shape": asdict(shape),
        "num_params": shape.parameters,  # (the model's own parameters may be ZeRO-3 partitions already)
        "dtype": dtype_of(raw, model),
        "world_size": world_size,
        "max_positions": max_positions(model),
    }

    def record(module, args, kwargs):
        seq = _sequence_length(args, kwargs) or info["max_positions"]
        if int(os.environ.get("RANK", 0)) == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({**info, "seq": seq}, indent=1))
            logger.info(f"autotuning probe: {info['num_params']:,} parameters, sequences of {seq}; wrote {path}")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)  # not SystemExit: a training loop's finally-blocks could start collectives and wait

    model.register_forward_pre_hook(record, with_kwargs=True, prepend=True)


def read_probe(path: str) -> dict:
    info = json.loads(Path(path).read_text())
    info["shape"] = ModelShape(**info["shape"])
    if not info.get("seq"):
        raise ValueError(f"the probe at {path} saw no sequence length and the model states no maximum")
    info["seq"] = int(info["seq"])
    return info
