"""`deepspeed.tp_model_init` (`deepspeed.runtime.tensor_parallel`): what Transformers calls before
the engine when `tensor_parallel.autotp_size` > 1. zerotron splits the model at `initialize` (from
the model's own plan, or zerotron's), so this only checks and records the size and casts to the
dtype; the split happens when the engine is built from the same config."""

from __future__ import annotations

import torch


def tp_model_init(model, tp_size, dtype=None, config=None, **kwargs):
    """Return `model` (in `dtype`) to be split `tp_size` ways by zerotron.initialize. `config`'s
    tensor_parallel.autotp_size, when given, must agree with `tp_size`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tp_model_init expects a torch.nn.Module, got {type(model).__name__}")
    tp_size = int(tp_size)
    if tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be >= 1, got {tp_size}")
    if config is not None:
        section = config.get("tensor_parallel", {}) if hasattr(config, "get") else {}
        given = section.get("autotp_size", tp_size) if hasattr(section, "get") else tp_size
        if given not in ("auto", tp_size):
            raise ValueError(
                f"tp_model_init(tp_size={tp_size}) disagrees with the config's "
                f"tensor_parallel.autotp_size ({given}); make them the same"
            )
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    model._zerotron_tp_size = tp_size
    return model


__all__ = ["tp_model_init"]
