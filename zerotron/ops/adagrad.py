"""Adagrad with DeepSpeed's CPU optimizer names: `DeepSpeedCPUAdagrad` (any device).

DeepSpeed's CPU Adagrad differs from torch's once weight decay is on: the decayed gradient
g + weight_decay * p goes into the sum of squares, but the step's numerator is the raw gradient:

    s = s + (g + wd * p)**2
    p = p - lr * g / (sqrt(s) + eps)

(torch puts the decayed gradient in the numerator too). Without weight decay the two are the same
update, and this class runs torch's fused Adagrad kernel (bit for bit torch.optim.Adagrad(fused=True)
with lr_decay 0 and initial_accumulator_value 0); with weight decay it runs DeepSpeed's form, one
foreach pass per group. Elementwise, so ZeRO runs it on flat shards.
"""

from __future__ import annotations

import warnings

import torch


class DeepSpeedCPUAdagrad(torch.optim.Optimizer):
    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
        if amsgrad:  # DeepSpeed accepts the argument and ignores it; say so rather than drop it
            warnings.warn(
                "DeepSpeedCPUAdagrad: Adagrad has no AMSGrad variant; amsgrad=True is ignored "
                "(as DeepSpeed ignores it)",
                stacklevel=2,
            )
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        self.fp32_optimizer_states = bool(fp32_optimizer_states)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            kinds: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DeepSpeedCPUAdagrad does not support sparse gradients")
                state = self.state[p]
                dtype = torch.float32 if self.fp32_optimizer_states and p.is_floating_point() else p.dtype
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["sum"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                kinds.setdefault((p.device, dtype, p.dtype), []).append((p, p.grad, state["sum"], state["step"]))
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for (_, dtype, pdtype), items in kinds.items():
                params, grads, sums, steps = (list(x) for x in zip(*items))
                torch._foreach_add_(steps, 1)
                if decay == 0 and dtype == pdtype:
                    torch._fused_adagrad_(
                        params, grads, sums, steps, lr=lr, lr_decay=0.0, weight_decay=0.0, eps=eps, maximize=False
                    )
                    continue
                work = [p if p.dtype == dtype else p.to(dtype) for p in params]
                grads = [g if g.dtype == dtype else g.to(dtype) for g in grads]
                decayed = torch._foreach_add(grads, work, alpha=decay) if decay != 0 else grads
                torch._foreach_addcmul_(sums, decayed, decayed)
                denom = torch._foreach_sqrt(sums)
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(work, grads, denom, value=-lr)
                for p, w in zip(params, work):
                    if w is not p:
                        p.copy_(w)
        return loss
