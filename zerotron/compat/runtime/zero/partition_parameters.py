"""`deepspeed.runtime.zero.partition_parameters`: Init, GatheredParameters (zerotron.zero),
ZeroParamStatus / ZeroParamType, and register_external_parameter."""
from __future__ import annotations

import enum

import torch

from ....zero import GatheredParameters, Init
from ....zero.partition_api import ZeroParamStatus  # the enum stage 3 sets on each parameter's ds_status


class ZeroParamType(enum.Enum):
    NORMAL = 1       # an ordinary parameter
    PARTITIONED = 2  # partitioned over the data-parallel ranks
    REMOTE = 3       # held by one rank only


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter):
    """Tell ZeRO-3 that `module`'s forward uses `parameter`, which another module owns. zerotron
    keeps the record (`module._external_params`, as DeepSpeed); its ZeRO-3 already keeps the
    root unit (embeddings, head, anything outside the repeated blocks) gathered through the
    whole forward and backward, which covers the usual case of a head tied to the embedding."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("register_external_parameter expects a torch.nn.Parameter")
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter):
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("unregister_external_parameter expects a torch.nn.Parameter")
    if id(parameter) not in getattr(module, "_external_params", {}):
        raise RuntimeError("this parameter is not a registered external parameter of the module")
    del module._external_params[id(parameter)]


__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "ZeroParamType", "register_external_parameter",
           "unregister_external_parameter"]
