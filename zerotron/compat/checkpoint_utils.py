"""`deepspeed.checkpoint.utils`: clone_tensors_for_torch_save (what accelerate's get_state_dict
calls below ZeRO-3)."""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of `item` (tensors, or lists/tuples/dicts of them) whose tensors are cloned to
    `device`, so torch.save writes each one's own data and not a whole shared storage."""
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
