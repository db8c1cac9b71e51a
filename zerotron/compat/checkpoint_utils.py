"""`deepspeed.checkpoint.utils`: clone_tensors_for_torch_save (what accelerate's get_state_dict
calls below ZeRO-3) and get_model_ckpt_name_for_rank (a DeepSpeed-layout checkpoint's file name)."""

from __future__ import annotations

import os

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


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str) -> str:
    """The model-states file of tensor-parallel rank `mp_rank_str` ("00") in a DeepSpeed-layout checkpoint
    directory (what DeepSpeed writes and zerotron's loader reads, checkpoint/deepspeed_layout.py); zerotron's own
    checkpoints keep the weights in per-rank safetensors files instead, so there is no such file in them."""
    return os.path.join(str(base_folder), f"mp_rank_{mp_rank_str}_model_states.pt")
