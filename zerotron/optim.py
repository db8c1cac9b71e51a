"""Optimizers: the config's "optimizer" section (DeepSpeed's names and parameters), and the check
that decides whether an optimizer may run on ZeRO's flat shards.

Config names, case-insensitive (DeepSpeed lower-cases its own names; torch's it takes as written,
zerotron takes them in any case):
- "Adam" / "AdamW": DeepSpeed's FusedAdam, decoupled weight decay unless `adam_w_mode` is false
  (for "Adam"). Built as torch.optim.AdamW/Adam(fused=True) (the same update bit for bit) or, with
  `bias_correction: false`, as zerotron.ops.adam.FusedAdam; with optimizer offload, CPUAdam.
- "Lion": zerotron.ops.lion.FusedLion (DeepSpeedCPULion with offload).
- "Adagrad": torch.optim.Adagrad (DeepSpeedCPUAdagrad with offload), as DeepSpeed builds them.
- "Lamb": zerotron.ops.lamb.FusedLamb; ZeRO stage 0 only (its trust ratio needs whole tensors).
- any other torch.optim class by name ("SGD", "RMSprop", "Adamax", "NAdam", ...), with its own
  parameter names, as DeepSpeed's getattr(torch.optim, type) does.
- "MuAdam" / "MuAdamW" / "MuSGD": from the `mup` package when it is installed.
Refused, with the reason and the fix: the 1-bit optimizers ("OneBitAdam", "ZeroOneAdam",
"OneBitLamb": compressed communication zerotron does not implement) and "Muon".
"""

from __future__ import annotations

import copy
import inspect

import torch

from .errors import ConfigError
from .log import warn

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
            from .ops.adam import FusedAdam

            return FusedAdam(model_parameters, bias_correction=False, adam_w_mode=decoupled, **kw)
        if on_host:
            from .ops.adam import CPUAdam

            return CPUAdam(model_parameters, adamw_mode=decoupled, **kw)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        # One fused kernel per parameter group: the fastest torch update on both CPU and CUDA.
        return cls(model_parameters, fused=True, **kw)
    if name == "lion":
        kw.pop("set_grad_none", None)
        from .ops.lion import DeepSpeedCPULion, FusedLion

        return (DeepSpeedCPULion if on_host else FusedLion)(model_parameters, **kw)
    if name == "lamb":
        from .ops.lamb import FusedLamb

        return FusedLamb(model_parameters, **kw)
    if name == "adagrad" and on_host:
        from .ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(model_parameters, **kw)
    if name in _MUP:
        import mup

        return getattr(mup, _MUP[name][0])(model_parameters, **kw)
    cls = _torch_optimizers()[name]
    if cls is torch.optim.SGD:
        kw.setdefault("foreach", True)
    return cls(model_parameters, **kw)


# --------------------------------------------------------------------------------------------
# Which optimizers may run on ZeRO's flat shards
# --------------------------------------------------------------------------------------------
def _trusted() -> set[type]:
    """Classes whose update is elementwise by construction (torch's and zerotron's own): not probed.
    Exact classes only: a subclass may override step() with anything, so it is probed."""
    from .ops.adagrad import DeepSpeedCPUAdagrad
    from .ops.adam import CPUAdam, FusedAdam
    from .ops.lion import DeepSpeedCPULion, FusedLion

    o = torch.optim
    return {
        o.SGD,
        o.Adam,
        o.AdamW,
        o.Adagrad,
        o.Adamax,
        o.NAdam,
        o.RAdam,
        o.RMSprop,
        o.ASGD,
        o.Rprop,
        o.Adadelta,
        CPUAdam,
        FusedAdam,
        FusedLion,
        DeepSpeedCPULion,
        DeepSpeedCPUAdagrad,
    }


def _known_not_elementwise(optimizer) -> str | None:
    """Why this optimizer (or a subclass of one) is known not to be elementwise, or None."""
    if getattr(optimizer, "elementwise", None) is False:
        return getattr(optimizer, "not_elementwise_because", "it says so (elementwise = False)")
    known = {
        "LBFGS": "it searches along directions built from dot products over all parameters at once",
        "Adafactor": "it factors each matrix's second moment into row and column statistics",
        "Muon": "it orthogonalizes each whole matrix (Newton-Schulz iterations on its 2-D shape)",
        "SparseAdam": "it takes only sparse gradients of whole tensors",
    }
    for name, why in known.items():
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(optimizer, cls):
            return why
    return None


def _rebuild(optimizer, groups):
    """A fresh instance of the optimizer's class over `groups` (each carrying a group's settings),
    with the instance's plain settings (e.g. an adam_w_mode attribute) copied over."""
    cls = type(optimizer)
    try:
        fresh = cls(groups, **optimizer.defaults)
    except TypeError:
        fresh = cls(groups)
    for key, value in vars(optimizer).items():
        if key.startswith("_") or key in ("defaults", "state", "param_groups"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            setattr(fresh, key, value)
    return fresh


def probe_elementwise(optimizer: torch.optim.Optimizer, device=None, steps: int = 3):
    """Does this optimizer's update treat every element on its own? Fresh instances with each
    param group's settings train two parameters (a matrix and a vector) whole, and the same numbers
    flattened and cut in two at an odd place, as two ranks' shards would hold them (one instance per
    piece: a shard's optimizer sees nothing of the other pieces), for `steps` steps with the same
    gradients. Returns ("elementwise", None), ("differs", detail) or ("untested", detail). The
    global RNG state is left as it was."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    shapes, cut = [(5, 6), (7,)], 13
    gen = torch.Generator().manual_seed(20240607)
    numel = sum(torch.Size(s).numel() for s in shapes)
    # Magnitudes that grow along the flat order: each piece's norms differ from the whole tensor's.
    scale = torch.linspace(0.2, 3.0, numel)
    flat0 = torch.randn(numel, generator=gen) * scale
    grads = [torch.randn(numel, generator=gen) * scale.flip(0) for _ in range(steps)]
    seen = set()
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        key = repr(sorted(hyper.items(), key=lambda kv: kv[0]))
        if key in seen:
            continue
        seen.add(key)
        lr = hyper.get("lr")
        if isinstance(lr, (int, float)) and lr == 0:  # a warm-up schedule may start at 0: nothing to compare
            hyper["lr"] = 1e-2
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            try:
                whole = [
                    torch.nn.Parameter(t.clone().reshape(s).to(device))
                    for t, s in zip(flat0.split([torch.Size(s).numel() for s in shapes]), shapes)
                ]
                pieces = [
                    torch.nn.Parameter(flat0[:cut].clone().to(device)),
                    torch.nn.Parameter(flat0[cut:].clone().to(device)),
                ]
                optimizers = [_rebuild(optimizer, [{"params": whole, **copy.deepcopy(hyper)}])] + [
                    _rebuild(optimizer, [{"params": [p], **copy.deepcopy(hyper)}]) for p in pieces
                ]
                for g in grads:
                    g = g.to(device)
                    for p, gp in zip(whole, g.split([p.numel() for p in whole])):
                        p.grad = gp.reshape(p.shape).clone()
                    pieces[0].grad, pieces[1].grad = g[:cut].clone(), g[cut:].clone()
                    for o in optimizers:
                        o.step()
            except Exception as e:  # noqa: BLE001 - any failure means: could not test
                return "untested", f"rebuilding it on a probe parameter and stepping failed: {type(e).__name__}: {e}"
        with torch.no_grad():
            a = torch.cat([p.detach().reshape(-1) for p in whole]).float().cpu()
            b = torch.cat([p.detach().reshape(-1) for p in pieces]).float().cpu()
        moved = (a - flat0).abs().max().item()
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            return "untested", "the probe's updates were not finite"
        if moved == 0:
            return "untested", "the probe's steps did not change the parameters"
        diff = (a - b).abs().max().item()
        if diff > 1e-4 * moved:
            return "differs", (
                f"after {steps} steps the parameters trained whole and in two pieces differ by "
                f"{diff:.2g} (the updates are ~{moved:.2g})"
            )
    return "elementwise", None


def check_shardable(optimizer: torch.optim.Optimizer, *, stage: int, device=None, allow_untested: bool = False) -> None:
    """Raise ValueError unless `optimizer` may run on ZeRO's flat shards (each rank updates a 1-D
    slice of the flattened parameters that can start and end inside a tensor), which is exact only
    when its update is elementwise. Torch's and zerotron's elementwise classes are trusted; classes
    known not to be elementwise are refused; any other is probed (`probe_elementwise`).
    `allow_untested` (DeepSpeed's "zero_allow_untested_optimizer": true) lets one that could not be
    tested, or that the probe found to differ, run anyway, with a warning."""
    cls = type(optimizer)
    if cls in _trusted():
        return
    name = cls.__name__
    head = (
        f"ZeRO stage {stage} runs the optimizer on flat shards of the parameters (each rank updates a 1-D slice "
        "that can cut through a tensor), which is exact only for elementwise optimizers. "
    )
    fix = (
        "Use zero_optimization.stage 0 (every rank updates whole tensors), or an elementwise optimizer (AdamW, "
        "Adam, SGD, Lion, Adagrad, ...)"
    )
    why = _known_not_elementwise(optimizer)
    if why is not None:
        raise ValueError(f"{head}{name} is not elementwise: {why}, which a flat shard does not have. {fix}.")
    verdict, detail = probe_elementwise(optimizer, device)
    if verdict == "elementwise":
        return
    if verdict == "differs":
        problem = (
            f"{name} is not elementwise: {detail}, so its update depends on whole-tensor norms or shapes, "
            "which a flat shard does not have."
        )
        if allow_untested:
            warn(
                f"{head}{problem} zero_allow_untested_optimizer is set, so it runs anyway: training will "
                "differ from one process"
            )
            return
        raise ValueError(f"{head}{problem} {fix}.")
    problem = f"{name} is not one zerotron knows to be elementwise, and it could not be tested ({detail})."
    if allow_untested:
        warn(
            f"{head}{problem} zero_allow_untested_optimizer is set, so it runs anyway: this is exact only "
            "if its update treats every element on its own"
        )
        return
    raise ValueError(
        f'{head}{problem} If its update is elementwise, set "zero_allow_untested_optimizer": true in '
        f"the config to use it anyway; otherwise: {fix}."
    )
