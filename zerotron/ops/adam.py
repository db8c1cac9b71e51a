"""Adam / AdamW: `FusedAdam` (DeepSpeed's GPU optimizer, any device) and `CPUAdam` (offloaded fp32 masters).

FusedAdam is torch's fused Adam/AdamW kernel behind DeepSpeed's signature, with DeepSpeed's
`bias_correction` switch (which torch lacks): see `FusedAdam`.

CPUAdam's update is torch's fused Adam kernel, run on cache-sized chunks of each (flat) tensor, spread
over a pool of threads (torch releases the GIL inside kernels). While a chunk is still in cache,
the updated weights can be copied out in the model's dtype (`copy_out`), which saves the separate
pass over memory that `param.copy_(master)` would cost. bench/cpu_adam.py measures it against
torch.optim.AdamW (foreach and fused) and DeepSpeed's C++ DeepSpeedCPUAdam.
"""
from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK = 1 << 18  # elements: with its gradient and two moments, ~4 MiB of fp32 in flight per chunk


class CPUAdam(torch.optim.Optimizer):
    """DeepSpeedCPUAdam's signature. `copy_out`: {parameter: tensor} to receive each updated
    parameter (any dtype, same number of elements) right after its chunk is updated."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True, threads: int | None = None,
                 chunk_numel: int = CHUNK):
        if not bias_correction:
            raise ValueError("CPUAdam always applies Adam's bias correction (bias_correction=False is not supported)")
        if not fp32_optimizer_states:
            raise ValueError("CPUAdam keeps its moments in fp32 (fp32_optimizer_states=False is not supported)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.chunk_numel = chunk_numel
        self.threads = threads or max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="zerotron-cpu-adam") if self.threads > 1 \
            else None
        self.copy_out: dict[torch.Tensor, torch.Tensor] = {}
        self._plan = None

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_pool", None)
        state.pop("_plan", None)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        signature = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise ValueError(f"CPUAdam updates fp32 tensors on the CPU; got a {p.dtype} tensor on {p.device}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                out = self.copy_out.get(p)
                signature.append((id(p), p.grad.data_ptr(), None if out is None else out.data_ptr()))
        # The work items (slices and their argument lists) are built once and reused while the
        # tensors stay the same: per-item Python work would otherwise rival the kernels' time.
        if self._plan is None or self._plan[0] != signature:
            self._plan = (signature, self._plan_work())
        work = self._plan[1]
        if self._pool is None:
            for item in work:
                self._update(*item)
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # parallel over work items, not inside each kernel
            # Each thread takes the next item as it frees up: balanced even when another process
            # takes a core, with one task per thread rather than one per item.
            claim = itertools.count()

            def drain():
                for i in iter(lambda: next(claim), None):
                    if i >= len(work):
                        return
                    self._update(*work[i])
            try:
                for future in [self._pool.submit(drain) for _ in range(self.threads)]:
                    future.result()
            finally:
                torch.set_num_threads(threads)
        return loss

    def _plan_work(self) -> list:
        """Work items of about chunk_numel elements: slices of large tensors, or several small
        tensors together (one kernel call over lists), so neither huge tensors nor many small ones
        leave threads idle. Each item: (group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, outs)."""
        work = []
        for group in self.param_groups:
            item, size = None, 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                tensors = [p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                           state["max_exp_avg_sq"] if group["amsgrad"] else None, self.copy_out.get(p)]
                flat = [None if t is None else t.view(-1) for t in tensors]
                for start in range(0, p.numel(), self.chunk_numel):
                    if item is None:
                        item = (group, [], [], [], [], [], [], [])
                    end = start + self.chunk_numel
                    for lst, t in zip(item[1:6], flat[:5]):
                        if t is not None:
                            lst.append(t[start:end])
                    item[6].append(state["step"])
                    item[7].append(None if flat[5] is None else (flat[0][start:end], flat[5][start:end]))
                    size += min(end, p.numel()) - start
                    if size >= self.chunk_numel:
                        work.append(item)
                        item, size = None, 0
            if item is not None:
                work.append(item)
        return work

    @torch.no_grad()  # grad mode is per thread: pool threads need it too
    def _update(self, group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, outs):
        kernel = torch._fused_adamw_ if self.adamw_mode else torch._fused_adam_
        beta1, beta2 = group["betas"]
        kernel(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, lr=group["lr"], beta1=beta1, beta2=beta2,
               weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=group["amsgrad"], maximize=False)
        for pair in outs:  # the updated slice, still in cache, into its model-dtype copy
            if pair is not None:
                pair[1].copy_(pair[0])


DeepSpeedCPUAdam = CPUAdam  # the name DeepSpeed scripts import


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

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (nor does DeepSpeed's); use "
                               "torch.optim.AdamW(..., amsgrad=True) instead")
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
                kernel(ps, grads, exp_avgs, exp_avg_sqs, [], counts, lr=group["lr"], beta1=beta1, beta2=beta2,
                       weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)
        return loss

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_uncorrected", {})
