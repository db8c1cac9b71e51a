"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with DeepSpeed's names:
`FusedLion` (DeepSpeed's GPU optimizer) and `DeepSpeedCPULion` (its CPU one). Torch has no Lion,
so the update is written here, one foreach pass per group and (device, dtype):

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)     (decoupled weight decay)
    m = beta2 * m + (1 - beta2) * g

Defaults are DeepSpeed's: betas (0.9, 0.999) (the paper suggests 0.99 for beta2), no weight
decay. Where c is exactly 0 this update leaves the element alone (sign(0) = 0, as in the paper);
DeepSpeed's own kernels disagree there (its CUDA kernel steps by +lr, its CPU kernel by -lr or +lr
after the sign bit of the zero). Elementwise, so ZeRO runs it on flat shards.
"""

from __future__ import annotations

import torch


class FusedLion(torch.optim.Optimizer):
    """DeepSpeed's `deepspeed.ops.lion.FusedLion`, on any device. `set_grad_none`: zero_grad()
    sets gradients to None (the default)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(tuple(betas)) != 2:
            raise ValueError(f"invalid betas {betas}: use two numbers in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.set_grad_none = set_grad_none
        self.fp32_optimizer_states = False  # moments in the parameter's dtype, as DeepSpeed's FusedLion

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

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
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                kinds.setdefault((p.device, dtype), []).append((p, p.grad, state["exp_avg"]))
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for (_, dtype), items in kinds.items():
                params = [p if p.dtype == dtype else p.to(dtype) for p, _, _ in items]  # fp32 work copies if asked
                grads = [g if g.dtype == dtype else g.to(dtype) for _, g, _ in items]
                exp_avgs = [m for _, _, m in items]
                direction = torch._foreach_mul(exp_avgs, beta1)
                torch._foreach_add_(direction, grads, alpha=1 - beta1)
                torch._foreach_sign_(direction)
                if decay != 0:
                    torch._foreach_mul_(params, 1 - lr * decay)
                torch._foreach_add_(params, direction, alpha=-lr)
                torch._foreach_mul_(exp_avgs, beta2)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)
                for (p, _, _), work in zip(items, params):
                    if work is not p:
                        p.copy_(work)
        return loss


class DeepSpeedCPULion(FusedLion):
    """DeepSpeed's `deepspeed.ops.lion.DeepSpeedCPULion` signature; the same update as FusedLion
    (any device). `fp32_optimizer_states`: keep the moment in fp32 for low-precision parameters."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay, set_grad_none=True)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
