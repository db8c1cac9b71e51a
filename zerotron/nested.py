"""Walking the nested values models take and return: tensors, tuples, lists, dicts, ModelOutputs."""

from __future__ import annotations

import torch


def tensors_in(value):
    """Every tensor inside `value`, depth first."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):  # Hugging Face's ModelOutput is a dict too
        for v in value.values():
            yield from tensors_in(v)


def to_device(value, device):
    """`value` with every tensor moved to `device` (asynchronously where the copy allows it)."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
