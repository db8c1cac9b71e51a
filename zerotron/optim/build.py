"""The config's "optimizer" section: which names and parameters it takes (validate_optimizer) and the
optimizer it builds (build_optimizer). The names are listed in zerotron/optim/__init__.py."""

from __future__ import annotations

import inspect

import torch

from ..errors import ConfigError
from ..log import warn

_ADAM_PARAMS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "bias_correction",
    "adam_w_mode",
    "torch_adam",
    "set_grad_none",
    "fp32_optimizer_states",
}
_LION_PARAMS = {"lr", "betas", "weight_decay", "set_grad_none", "fp32_optimizer_states"}
_LAMB_PARAMS = {
    "lr",
    "bias_correction",
    "betas",
    "eps",
    "eps_inside_sqrt",
    "weight_decay",
    "max_coeff",
    "min_coeff",
    "amsgrad",
}
_CPU_ADAGRAD_PARAMS = {"lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states"}
_MUP = {
    "muadam": ("MuAdam", torch.optim.Adam),
    "muadamw": ("MuAdamW", torch.optim.AdamW),
    "musgd": ("MuSGD", torch.optim.SGD),
}
_ONE_BIT = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB"}
_UNBUILDABLE = {  # torch.optim classes the engine cannot drive from a config
    "lbfgs": "LBFGS needs a closure that re-evaluates the model at every step, which engine.step() does not have",
    "sparseadam": "SparseAdam takes only sparse gradients, and the engine's gradients are dense",
}
# Non-elementwise optimizers by config name, refused under ZeRO 1-3 before anything is built.
_NOT_ELEMENTWISE_NAMES = {"lamb": "Lamb", "adafactor": "Adafactor"}


def _torch_optimizers() -> dict[str, type]:
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }


def _init_params(cls) -> set[str]:
    sig = inspect.signature(cls.__init__)
    return {
        n
        for n, p in sig.parameters.items()
        if n not in ("self", "params", "model_params", "model_parameters")
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _valid_params(name: str, params: dict, on_host: bool) -> set[str]:
    if name in ("adam", "adamw"):
        return _ADAM_PARAMS
    if name == "lion":
        return _LION_PARAMS
    if name == "lamb":
        return _LAMB_PARAMS
    if name == "adagrad" and on_host:
        return _CPU_ADAGRAD_PARAMS
    if name in _MUP:
        return _init_params(_MUP[name][1]) | {"impl", "decoupled_wd"}
    return _init_params(_torch_optimizers()[name])


def validate_optimizer(type_name: str, params: dict, *, zero_stage: int = 0, on_host: bool = False) -> None:
    """Raise ConfigError (key, value, fix) unless zerotron builds this optimizer section as DeepSpeed
    would. `zero_stage`, `on_host` (optimizer offload): what the rest of the config says."""
    name = str(type_name).lower()
    if name in _ONE_BIT:
        raise ConfigError(
            "optimizer.type",
            type_name,
            f"{_ONE_BIT[name]} compresses the gradient all-reduce to 1 bit with error feedback, which "
            "zerotron does not implement (training would differ); use 'Adam' or 'Lamb' (the same "
            "optimizer with exact communication), or pass your own torch optimizer to "
            "zerotron.initialize(optimizer=...)",
        )
    if name == "muon":
        raise ConfigError(
            "optimizer.type",
            type_name,
            "zerotron does not build Muon from the config; pass your own (e.g. torch.optim.Muon for "
            "the matrices) to zerotron.initialize(optimizer=...) with zero_optimization.stage 0 "
            "(Muon orthogonalizes whole matrices, which ZeRO's flat shards do not hold), or use 'AdamW'",
        )
    if name in _UNBUILDABLE:
        raise ConfigError("optimizer.type", type_name, _UNBUILDABLE[name] + "; use 'AdamW' or 'SGD'")
    if name in _MUP:
        try:
            import mup  # noqa: F401
        except ImportError:
            raise ConfigError(
                "optimizer.type",
                type_name,
                "MuAdam, MuAdamW and MuSGD come from the mup package: "
                "pip install mup (and call mup.set_base_shapes on the model)",
            ) from None
    elif name not in ("adam", "adamw", "lion", "lamb") and name not in _torch_optimizers():
        raise ConfigError(
            "optimizer.type",
            type_name,
            "use one of DeepSpeed's 'Adam', 'AdamW', 'Lion', 'Adagrad', 'Lamb' or a torch.optim "
            "optimizer's name ('SGD', 'RMSprop', ...), or pass your own torch optimizer to "
            "zerotron.initialize(optimizer=...)",
        )
    if zero_stage >= 1 and name in _NOT_ELEMENTWISE_NAMES:
        raise ConfigError(
            "optimizer.type",
            type_name,
            f"{_NOT_ELEMENTWISE_NAMES[name]} is not elementwise (its update uses whole-tensor norms "
            f"or shapes), and ZeRO stage {zero_stage} updates flat shards that cut through tensors, so "
            "it would train a different model; use zero_optimization.stage 0, or an elementwise "
            "optimizer such as 'AdamW' or 'Lion' (zero_allow_untested_optimizer cannot make it exact)",
        )
    valid = _valid_params(name, params, on_host)
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if key == "max_grad_norm":
            raise ConfigError(
                where,
                value,
                "clipping is not an optimizer parameter; set the top-level 'gradient_clipping' key instead",
            )
        if key not in valid:
            offload = " with optimizer offload (DeepSpeedCPUAdagrad)" if on_host and name == "adagrad" else ""
            raise ConfigError(where, value, f"unknown parameter for {type_name}{offload}; valid: {sorted(valid)}")
    lr = params.get("lr", 1e-3)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0:
        raise ConfigError("optimizer.params.lr", lr, "use a non-negative number, e.g. 1e-3")
    if "betas" in valid:
        betas = params.get("betas", [0.9, 0.999])
        if (
            not isinstance(betas, (list, tuple))
            or len(betas) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError("optimizer.params.betas", betas, "use two numbers in [0, 1), e.g. [0.9, 0.999]")
    for key in ("eps", "weight_decay", "momentum", "dampening", "max_coeff", "min_coeff"):
        if key in params:
            v = params[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"optimizer.params.{key}", v, "use a non-negative number")
    for key in (
        "bias_correction",
        "adam_w_mode",
        "torch_adam",
        "amsgrad",
        "set_grad_none",
        "fp32_optimizer_states",
        "eps_inside_sqrt",
        "nesterov",
    ):
        if key in params and not isinstance(params[key], bool):
            raise ConfigError(f"optimizer.params.{key}", params[key], "expected true or false")
    if name in ("adam", "adamw"):
        if params.get("bias_correction", True) is False and params.get("torch_adam", False):
            raise ConfigError(
                "optimizer.params.bias_correction",
                False,
                "torch's Adam (torch_adam: true) always applies bias correction; remove torch_adam "
                "(zerotron's FusedAdam then trains without it) or the bias_correction key",
            )
        if params.get("bias_correction", True) is False and params.get("amsgrad", False):
            raise ConfigError(
                "optimizer.params.amsgrad",
                True,
                "AMSGrad without bias correction is not available (DeepSpeed's FusedAdam refuses "
                "AMSGrad); remove one of amsgrad and bias_correction",
            )
    if name == "lamb" and params.get("min_coeff", 0.01) > params.get("max_coeff", 10.0):
        raise ConfigError("optimizer.params.min_coeff", params["min_coeff"], "it must not exceed max_coeff")
    if params.get("fp32_optimizer_states", True) is False and name in ("adam", "adamw", "lion", "adagrad"):
        warn(
            "optimizer.params.fp32_optimizer_states = false: zerotron keeps optimizer moments in fp32 "
            "(more memory than asked; the update is at least as precise)"
        )


def build_optimizer(type_name: str, params: dict, model_parameters, on_host: bool = False) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed would build for this config entry (see the module docstring).

    DeepSpeed's "Adam" decouples weight decay (AdamW) unless `adam_w_mode` is false; we keep that
    so a DeepSpeed config trains the same model here. `on_host` (optimizer offload): Adam and
    AdamW become zerotron.ops.adam.CPUAdam, as DeepSpeed uses DeepSpeedCPUAdam (FusedAdam on the
    host without bias correction, which CPUAdam does not do); Lion and Adagrad their CPU classes.
    """
    validate_optimizer(type_name, params, on_host=on_host)
    name = str(type_name).lower()
    kw = dict(params)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    kw.pop("fp32_optimizer_states", None)  # moments are fp32 here (warned about by validate_optimizer)
    if name in ("adam", "adamw"):
        decoupled = name == "adamw" or kw.pop("adam_w_mode", True)
        kw.pop("adam_w_mode", None)
        kw.pop("torch_adam", None)
        kw.pop("set_grad_none", None)  # the engine's zero_grad decides
        if kw.pop("bias_correction", True) is False:
            from ..ops.adam import FusedAdam

            return FusedAdam(model_parameters, bias_correction=False, adam_w_mode=decoupled, **kw)
        if on_host:
            from ..ops.adam import CPUAdam

            return CPUAdam(model_parameters, adamw_mode=decoupled, **kw)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        # One fused kernel per parameter group: the fastest torch update on both CPU and CUDA.
        return cls(model_parameters, fused=True, **kw)
    if name == "lion":
        kw.pop("set_grad_none", None)
        from ..ops.lion import DeepSpeedCPULion, FusedLion

        return (DeepSpeedCPULion if on_host else FusedLion)(model_parameters, **kw)
    if name == "lamb":
        from ..ops.lamb import FusedLamb

        return FusedLamb(model_parameters, **kw)
    if name == "adagrad" and on_host:
        from ..ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(model_parameters, **kw)
    if name in _MUP:
        import mup

        return getattr(mup, _MUP[name][0])(model_parameters, **kw)
    cls = _torch_optimizers()[name]
    if cls is torch.optim.SGD:
        kw.setdefault("foreach", True)
    return cls(model_parameters, **kw)


def check_client_on_host(optimizer: torch.optim.Optimizer, config) -> torch.optim.Optimizer:
    """DeepSpeed's "zero_force_ds_cpu_optimizer": true refuses a client optimizer under optimizer offload unless it
    is the host optimizer (DeepSpeedCPUAdam or DeepSpeedCPULion); returns `optimizer` otherwise. Unset, zerotron
    runs the client's class on the host shards (the same update; torch's speed), where DeepSpeed's default (true)
    refuses: the key says to refuse only where a config asks for it."""
    from ..ops.adam import CPUAdam
    from ..ops.lion import DeepSpeedCPULion

    off = config.zero_optimization.offload_optimizer
    if config.zero_force_ds_cpu_optimizer and off is not None and off.device == "cpu":
        if not isinstance(optimizer, (CPUAdam, DeepSpeedCPULion)):
            raise ConfigError(
                "zero_force_ds_cpu_optimizer",
                True,
                f"optimizer offload with the client optimizer {type(optimizer).__name__}: pass "
                "deepspeed.ops.adam.DeepSpeedCPUAdam (or DeepSpeedCPULion), or an 'optimizer' section, or set "
                "zero_force_ds_cpu_optimizer to false to run this one on the host",
            )
    return optimizer
