"""LAMB (You et al. 2019) with DeepSpeed's semantics: `FusedLamb` (any device).

Per parameter tensor, as DeepSpeed's kernel computes it:

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    u = m / (sqrt(v) + eps) + weight_decay * p           (eps_inside_sqrt: m / sqrt(v + eps))
    r = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0   (the trust ratio)
    p = p - lr * sqrt(1 - beta2**t) / (1 - beta1**t) * r * u   (bias_correction=False: p - lr * r * u)

The trust ratio needs each parameter's whole norm, so LAMB is not elementwise: ZeRO stages 1-3,
which update flat shards cutting through tensors, refuse it (zerotron.optim.check_shardable);
use it with zero_optimization.stage 0.
"""

from __future__ import annotations

import math

import torch


class FusedLamb(torch.optim.Optimizer):
    """DeepSpeed's `deepspeed.ops.lamb.FusedLamb` signature. `max_grad_norm` (clipping inside the
    optimizer, from norms handed to step()) is refused: set the config's `gradient_clipping`."""

    elementwise = False  # read by zerotron.optim.check_shardable
    not_elementwise_because = "its trust ratio ||w|| / ||update|| is a norm over each whole parameter tensor"

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        amsgrad=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant (nor does DeepSpeed's)")
        if max_grad_norm and max_grad_norm > 0:
            raise ValueError(
                "FusedLamb(max_grad_norm=...) clips with norms handed to step(), which the engine does "
                "not hand in; set the config's 'gradient_clipping' instead"
            )
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff ({min_coeff}) <= max_coeff ({max_coeff})")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=0.0,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLamb does not support sparse gradients")
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v + group["eps"]).sqrt_() if self.eps_inside_sqrt else v.sqrt().add_(group["eps"])
                update = m / denom
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
                coeff = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
                step_size = group["lr"]
                if group["bias_correction"]:
                    step_size = step_size * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.add_(update.mul_(coeff), alpha=-step_size)
                self.lamb_coeffs.append(coeff)
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per parameter updated (as DeepSpeed's)."""
        return [c.item() for c in self.lamb_coeffs]
