"""bench/cpu_adam.py's systems: each optimizer under test (zerotron's CPUAdam, torch AdamW foreach / fused,
DeepSpeedCPUAdam) over its own copy of the masters, stepped as its engine steps (System), and the clipping
coefficients every system shares."""

from __future__ import annotations

import time

import torch

from tools import training

ADAMW = training.ADAMW
CLIP = 1.0  # gradient clipping of the offload mode: the benchmark's gradients have norms of ~4-40
ZEROTRON = ("zt", "zt_bf16")


# ---- systems ----------------------------------------------------------------------------------------
def deepspeed_status() -> tuple[type | None, str]:
    """(DeepSpeedCPUAdam, "") when its op loads, else (None, why not)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as e:  # ImportError, or deepspeed failing to initialise its accelerator
        return None, f"deepspeed not importable: {type(e).__name__}: {e}"
    try:
        builder = CPUAdamBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "CPUAdamBuilder().is_compatible() is False on this machine"
        t0 = time.perf_counter()
        builder.load(verbose=False)  # JIT build (minutes the first time; cached in ~/.cache/torch_extensions)
        print(f"DeepSpeed cpu_adam op loaded in {time.perf_counter() - t0:.1f} s")
    except Exception as e:
        return None, f"cpu_adam op did not build/load: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}"
    return DeepSpeedCPUAdam, ""


class System:
    """One optimizer over its own copy of the masters, with a bf16 tensor per master (the weights
    the device gets back) and a host gradient buffer per master (where the gradients arrive)."""

    def __init__(
        self,
        name: str,
        init: list[torch.Tensor],
        grads: list[list[torch.Tensor]],
        clip_coefs: list,
        ds_cls=None,
        zt_chunk: int | None = None,
    ):
        self.name, self.grads, self.clip_coefs, self.n = name, grads, clip_coefs, 0
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        self.bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in init]
        # offload: DeepSpeed's gradients arrive in fp32 (the device converts them before the copy),
        # and so do zt's (the same input); zerotron's engine sends them in bf16, into the buffer the
        # bf16 weights leave from (its staging buffer): zt_bf16
        self.host_grads = self.bf16 if name == "zt_bf16" else [torch.empty_like(t) for t in init]
        kw = dict(lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
        if name in ZEROTRON:
            from zerotron.ops.adam import CPUAdam

            self.opt = CPUAdam(self.params, **kw, **({"chunk_numel": zt_chunk} if zt_chunk else {}))
        elif name == "torch_foreach":
            self.opt = torch.optim.AdamW(self.params, foreach=True, **kw)
        elif name == "torch_fused":
            self.opt = torch.optim.AdamW(self.params, fused=True, **kw)
        elif name == "ds":
            self.opt = ds_cls(self.params, adamw_mode=True, **kw)
        else:
            raise ValueError(name)

    def prepare(self, mode: str) -> None:
        """Untimed: this step's gradient (and, for zerotron, where it reads it and whether to copy
        out). Offload: the gradient is first copied into the host buffer, as its transfer would."""
        grads = self.grads[self.n % len(self.grads)]
        if mode != "offload":
            for p, g in zip(self.params, grads):
                p.grad = g
            if self.name in ZEROTRON:
                self.opt.grad_in = {}
                self.opt.copy_out = dict(zip(self.params, self.bf16)) if mode == "step+bf16" else {}
            return
        torch._foreach_copy_(self.host_grads, grads)
        if self.name in ZEROTRON:
            for p in self.params:
                p.grad = None
            self.opt.grad_in = dict(zip(self.params, self.host_grads))
            self.opt.copy_out = dict(zip(self.params, self.bf16))
        else:
            for p, g in zip(self.params, self.host_grads):
                p.grad = g

    def step(self, mode: str) -> None:
        coef = self.clip_coefs[self.n % len(self.grads)]
        if mode == "offload" and self.name in ZEROTRON:  # unscale/clip, Adam and the bf16 copy in one pass
            self.opt.grad_multipliers = (coef,)
            self.opt.step()
            self.opt.grad_multipliers = ()
        else:
            if mode == "offload":  # DeepSpeed's host side: unscale and clip in one pass, the step, the copy
                torch._foreach_mul_(self.host_grads, coef)
            self.opt.step()
            if mode in ("step+bf16", "offload") and self.name not in ZEROTRON:
                if len(self.params) == 1:
                    self.bf16[0].copy_(self.params[0])
                else:
                    torch._foreach_copy_(self.bf16, self.params)
        self.n += 1

    def timed(self, mode: str) -> float:
        self.prepare(mode)
        t0 = time.perf_counter()
        self.step(mode)
        return (time.perf_counter() - t0) * 1e3


def clip_coefficients(grads) -> list[torch.Tensor]:
    """Each gradient's clipping coefficient, from norms taken on the device as the gradients leave
    it (zerotron and DeepSpeed both do: off the host's clock), the engine's way; every system uses
    the same one, so all take the same steps, bit for bit."""
    from zerotron.precision import clip_coefficient, global_norm

    return [
        clip_coefficient(global_norm(torch._foreach_norm([t.bfloat16() for t in g], 2, dtype=torch.float32)), CLIP)
        for g in grads
    ]
