"""Optimizers named in the config ("Adam", "AdamW", "SGD") with DeepSpeed's parameter names."""
from __future__ import annotations

import torch

from .errors import ConfigError

_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "torch_adam"}
_SGD_PARAMS = {"lr", "momentum", "dampening", "weight_decay", "nesterov"}
OPTIMIZERS = {"adam": _ADAM_PARAMS, "adamw": _ADAM_PARAMS, "sgd": _SGD_PARAMS}


def validate_optimizer(type_name: str, params: dict) -> None:
    name = str(type_name).lower()
    if name not in OPTIMIZERS:
        raise ConfigError("optimizer.type", type_name, "use one of 'Adam', 'AdamW' or 'SGD', or pass your "
                          "own torch optimizer to zerotron.initialize(optimizer=...)")
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if key == "max_grad_norm":
            raise ConfigError(where, value, "clipping is not an optimizer parameter; set the top-level "
                              "'gradient_clipping' key instead")
        if key not in OPTIMIZERS[name]:
            raise ConfigError(where, value, f"unknown parameter for {type_name}; valid: {sorted(OPTIMIZERS[name])}")
    lr = params.get("lr", 1e-3)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0:
        raise ConfigError("optimizer.params.lr", lr, "use a non-negative number, e.g. 1e-3")
    betas = params.get("betas", [0.9, 0.999])
    if name != "sgd" and (not isinstance(betas, (list, tuple)) or len(betas) != 2
                          or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError("optimizer.params.betas", betas, "use two numbers in [0, 1), e.g. [0.9, 0.999]")
    for key in ("eps", "weight_decay", "momentum", "dampening"):
        v = params.get(key, 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"optimizer.params.{key}", v, "use a non-negative number")
    if params.get("bias_correction", True) is not True:
        raise ConfigError("optimizer.params.bias_correction", params["bias_correction"],
                          "zerotron's Adam always applies bias correction; remove the key")


def build_optimizer(type_name: str, params: dict, model_parameters, on_host: bool = False) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed would build for this config entry.

    DeepSpeed's "Adam" decouples weight decay (AdamW) unless `adam_w_mode` is false; we keep that
    so a DeepSpeed config trains the same model here. `on_host` (optimizer offload): Adam and
    AdamW become zerotron.ops.adam.CPUAdam, as DeepSpeed uses DeepSpeedCPUAdam.
    """
    validate_optimizer(type_name, params)
    name = type_name.lower()
    kw = {k: v for k, v in params.items() if k not in ("bias_correction", "adam_w_mode", "torch_adam")}
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    if name == "sgd":
        return torch.optim.SGD(model_parameters, foreach=True, **kw)
    decoupled = name == "adamw" or params.get("adam_w_mode", True)
    if on_host:
        from .ops.adam import CPUAdam
        return CPUAdam(model_parameters, adamw_mode=decoupled, **kw)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    # One fused kernel per parameter group: the fastest torch update on both CPU and CUDA.
    return cls(model_parameters, fused=True, **kw)
