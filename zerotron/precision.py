"""Mixed precision: dtype policy, fp32 master weights, the fp16 loss scaler, global-norm clipping."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .config import Config, FP16Config

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def model_dtype(config: Config) -> torch.dtype:
    return DTYPES[config.model_dtype_name]


def cast_module(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | None) -> torch.nn.Module:
    """`module`'s floating parameters and persistent buffers in `dtype`, everything on `device` (None: where it
    is). A non-persistent buffer is a constant the model computed for itself (rotary frequencies, masks) and keeps
    its dtype, as DeepSpeed 0.19.8 keeps buffers: bf16 rotary frequencies give other positions, other losses.
    Persistent ones (BatchNorm's running statistics) follow the parameters: torch's batch_norm needs them in the
    parameters' dtype (DeepSpeed, casting no buffer, fails there)."""
    kept = {id(m._buffers[n]) for m in module.modules() for n in m._non_persistent_buffers_set if n in m._buffers}

    def cast(t):
        to = dtype if t.is_floating_point() and id(t) not in kept else t.dtype
        return t.to(dtype=to) if t.is_meta or device is None else t.to(device, dtype=to)

    return module._apply(cast)


class LossScaleAtMinimum(RuntimeError):
    pass


class LossScaler:
    """DeepSpeed's loss scaler: static (`loss_scale` > 0) or dynamic (`loss_scale` 0).

    Dynamic: an overflow first spends the hysteresis budget, then halves the scale (never below
    `min_loss_scale`; an overflow at the minimum is an error, since training would only repeat it).
    After `loss_scale_window` clean steps since the last overflow, the scale doubles and the
    hysteresis budget is refilled.
    """

    def __init__(self, cfg: FP16Config | None = None):
        cfg = cfg or FP16Config()
        self.enabled = cfg.enabled
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        self.scale = float(2**cfg.initial_scale_power) if self.dynamic else (cfg.loss_scale if cfg.enabled else 1.0)
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.hysteresis_left = cfg.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if self.dynamic:
            self._update_dynamic(overflow)
        self.iteration += 1

    def _update_dynamic(self, overflow: bool):
        if overflow:
            if self.hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise LossScaleAtMinimum(
                        f"fp16 gradients overflowed at the minimum loss scale {self.scale:g} (step {self.iteration}); "
                        "the model diverges in fp16: lower the learning rate, set fp16.min_loss_scale lower, "
                        "or train in bf16"
                    )
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        clean = self.iteration - self.last_overflow - 1
        if clean > 0 and clean % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "hysteresis_left", "iteration", "last_overflow")}

    def load_state_dict(self, state: dict):
        for k, v in state.items():
            setattr(self, k, v)


class MasterWeights:
    """fp32 copies of low-precision parameters: the optimizer updates these, the model gets copies.

    In fp32 training the "masters" are the model parameters themselves and nothing is copied.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.model_params = params
        self.separate = any(p.dtype != torch.float32 for p in params)
        if self.separate:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
            for m in self.masters:
                m.grad = torch.zeros_like(m)
        else:
            self.masters = params

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the optimizer's param groups at the masters (keeping each group's settings)."""
        if not self.separate:
            return
        if optimizer.state:
            raise ValueError("the optimizer already has state; pass a fresh optimizer to zerotron.initialize")
        index = {id(p): m for p, m in zip(self.model_params, self.masters)}
        for group in optimizer.param_groups:
            group["params"] = [index.get(id(p), p) for p in group["params"]]

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters]

    def take_grads(self, inv_scale: float | None) -> torch.Tensor | None:
        """Copy model grads into the fp32 master grads, unscaling; a flag tensor, nonzero when any
        was inf/nan (read in the step's one host sync, Engine._agree)."""
        model_grads = [p.grad for p in self.model_params]
        master_grads = self.grads()
        if self.separate:
            torch._foreach_copy_(master_grads, model_grads)
        if inv_scale is None:
            return None
        return nonfinite_and_unscale(master_grads, inv_scale)

    def copy_to_model(self) -> None:
        if self.separate:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.model_params], self.masters)


def nonfinite_and_unscale(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply `grads` by `inv_scale` in place; returns a flag tensor, nonzero when any held inf/nan."""
    found_inf = torch.zeros(1, device=grads[0].device)
    inv = torch.full((1,), inv_scale, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
    return found_inf


def norm_share(param, tp: int) -> float:
    """The weight of a parameter's squared gradient norm on this rank: a tensor held by several
    ranks of the norm's groups (tensor-parallel replicas, a weight tied across pipeline stages)
    must count once in total."""
    share = 1.0 / getattr(param, "tied_copies", 1)
    return share / tp if tp > 1 and getattr(param, "tp_replicated", False) else share


def clip_by_global_norm(
    grads: list[torch.Tensor], max_norm: float, groups=None, weights: list[float] | None = None
) -> torch.Tensor:
    """Scale `grads` so their joint L2 norm is at most `max_norm`; returns the norm before clipping.

    `grads` may be shards: the squared norms are summed over each process group in `groups` (a
    group, a list of groups, or None). `weights` scale each tensor's squared norm, e.g. 1/tp for
    a tensor every tensor-parallel rank holds a copy of, so it is counted once.
    """
    if not grads:
        return torch.zeros(())
    total = global_norm(torch._foreach_norm(grads), groups, weights)
    if max_norm > 0:
        torch._foreach_mul_(grads, clip_coefficient(total, max_norm).to(grads[0].device))
    return total


def global_norm(norms: list[torch.Tensor], groups=None, weights: list[float] | None = None) -> torch.Tensor:
    """The joint L2 norm of tensors whose own norms are `norms` (see clip_by_global_norm)."""
    if not norms:
        return torch.zeros(())
    squares = torch.stack([n.float() for n in norms]).square()
    if weights is not None:
        squares = squares * _constant(tuple(weights), squares.device)
    from .comm import comm_for, to_device

    total_sq = to_device(squares.sum())  # offloaded gradients are in host memory; collectives run on the device
    for group in groups if isinstance(groups, (list, tuple)) else [groups]:
        if group is not None and dist.get_world_size(group) > 1:
            comm_for(group, "norm").all_reduce(total_sq)
    return total_sq.sqrt()


@functools.lru_cache(maxsize=16)
def _constant(values: tuple, device: torch.device) -> torch.Tensor:
    """fp32 `values` on `device`, made once: a tensor made from Python numbers each step would be a
    copy from pageable host memory, which waits for the GPU to drain."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradients are multiplied by so their norm `total` is at most `max_norm` (torch's rule)."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)
