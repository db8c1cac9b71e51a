"""`deepspeed.runtime.zero.partition_parameters`: Init, GatheredParameters (zerotron.zero),
ZeroParamStatus / ZeroParamType, and register_external_parameter."""

from __future__ import annotations

import enum

import torch

from ....zero import GatheredParameters, Init
from ....zero.partitioned_init import ZeroParamStatus  # the enum stage 3 sets on each parameter's ds_status

# DeepSpeed's zero.Init swaps torch's tensor constructors for wrappers that cast floating-point
# results to the Init dtype (and place them on the device); Transformers' `prevent_arange_dtype_change`
# reads and replaces the wrapper factory around `zero.Init` so RoPE's `torch.arange(..., dtype=...)`
# keeps its dtype. zerotron's Init does not wrap the constructors (parameters are cast and
# partitioned after each module's __init__), so the factory here is the DeepSpeed-shaped hook with
# nothing calling it: replacing it is harmless and changes nothing.
_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """DeepSpeed's factory: `fn` with floating-point results cast to `target_fp_dtype` on
    `target_device`. zerotron's zero.Init never calls it (see above); provided for code that
    reads, wraps or calls it."""

    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn


class ZeroParamType(enum.Enum):
    NORMAL = 1  # an ordinary parameter
    PARTITIONED = 2  # partitioned over the data-parallel ranks
    REMOTE = 3  # held by one rank only


# The shape a ZeRO-3 parameter's data has while released: an empty 1-D placeholder (zerotron/zero/residency.py).
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """DeepSpeed's ZeRO-3 internals wrap several in-flight parameter all-gathers in this object. zerotron's
    gather/release (zerotron/zero) waits on its own collectives, so the name exists for imports and construction
    is refused."""

    def __init__(self, handles, *args, **kwargs):
        raise NotImplementedError(
            "MultipleAllGatherHandles is DeepSpeed's internal ZeRO-3 all-gather bookkeeping; zerotron gathers "
            "parameters itself (zerotron.zero.GatheredParameters is the public way to gather them)"
        )


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


__all__ = [
    "zero_wrapper_for_fp_tensor_constructor",
    "Init",
    "GatheredParameters",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
]
