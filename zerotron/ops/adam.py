"""Adam / AdamW under DeepSpeed's names: `FusedAdam` (DeepSpeed's GPU optimizer, any device) and
`CPUAdam` / `DeepSpeedCPUAdam` (offloaded fp32 masters; zerotron/ops/cpu_adam.py).

FusedAdam is torch's fused Adam/AdamW kernel behind DeepSpeed's signature, with DeepSpeed's
`bias_correction` switch (which torch lacks): see `FusedAdam`.
"""

from __future__ import annotations

import math

import torch

from .cpu_adam import CHUNK, CPUAdam, DeepSpeedCPUAdam  # noqa: F401 (DeepSpeed's module path)


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed's `deepspeed.ops.adam.FusedAdam` on torch's fused Adam/AdamW kernels (CPU or GPU).

    `adam_w_mode`: decoupled weight decay (AdamW, the default) or L2 added to the gradient (Adam).
    `bias_correction` (per group): with True the update is torch.optim.AdamW(fused=True)'s, bit for
    bit. With False the moments are used as they are (m / (sqrt(v) + eps)), as DeepSpeed's kernel
    does: torch's kernel divides by 1 - beta**step, so it is handed a step count of +inf, where
    beta**step is exactly 0 and both corrections are exactly 1 (the real count stays in
    state["step"]). AMSGrad is refused, as DeepSpeed refuses it. `set_grad_none`: zero_grad() sets
    gradients to None (the default) rather than zeroing them.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        if amsgrad:
            raise RuntimeError(
                "FusedAdam does not support the AMSGrad variant (nor does DeepSpeed's); use "
                "torch.optim.AdamW(..., amsgrad=True) instead"
            )
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none
        self._uncorrected: dict[torch.device, torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _infinite_step(self, device) -> torch.Tensor:
        t = self._uncorrected.get(device)
        if t is None:
            t = self._uncorrected[device] = torch.full((), math.inf, dtype=torch.float32, device=device)
        return t

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kernel = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        for group in self.param_groups:
            kinds: dict = {}  # one kernel call per (device, dtype), as torch's fused AdamW does
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lists = kinds.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                    lst.append(t)
            beta1, beta2 = group["betas"]
            for (device, _), (ps, grads, exp_avgs, exp_avg_sqs, steps) in kinds.items():
                torch._foreach_add_(steps, 1)
                counts = steps if group["bias_correction"] else [self._infinite_step(device)] * len(ps)
                kernel(
                    ps,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    [],
                    counts,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                )
        return loss

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_uncorrected", {})
