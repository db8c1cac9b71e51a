"""`deepspeed.utils.module_utils` (and its old home `deepspeed.compression.helper`, which DeepSpeed-Chat's
LoRA code imports): a module's sub-module by dotted name, got or replaced."""

from __future__ import annotations

import functools

import torch.nn as nn


def recursive_getattr(model: nn.Module, module_name: str):
    """`model.a.b.c` for "a.b.c"."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """Set `model.a.b.c = module` for "a.b.c" (the parent found by name, the last part assigned)."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)
