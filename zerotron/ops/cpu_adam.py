"""CPUAdam: Adam / AdamW for fp32 master weights in host memory (ZeRO-Offload), fused with the
rest of the offloaded step.

The update is torch's fused Adam kernel, run on cache-sized chunks of each tensor by a pool of
threads (torch releases the GIL inside kernels; a free thread takes the next chunk, which keeps
both cores busy even when another process takes one). What the host step does around the update
happens to each chunk while it is in cache, so that the step streams through memory once instead
of once per operation:

- `grad_in[p]`: read p's gradient from this tensor (any float dtype, e.g. the bf16 shard the
  device sent) instead of p.grad; each chunk becomes fp32 in a per-thread scratch buffer, so no
  fp32 copy of the whole gradient is ever made;
- `grad_multipliers`: fp32 scalars each gradient chunk is multiplied by before its update, in
  order (the loss scale's inverse, the clipping coefficient): the same products as separate
  unscale and clip passes, bit for bit, without writing the gradient back;
- `copy_out[p]`: the updated chunk is written in the model's dtype right after its update.

zerotron/zero/offload.py's FusedHostStep drives it in the engine's offloaded step.

bench/cpu_adam.py measures it against torch.optim.AdamW (foreach and fused) and DeepSpeed's C++
DeepSpeedCPUAdam, with and without the offloaded step's other passes.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

CHUNK = 1 << 19  # elements: a chunk's weights, gradient and moments (8 MiB of fp32) stay in the L3 cache


@dataclass
class _Item:
    """One unit of work: slices of one or more parameters, ~chunk_numel elements in all."""

    group: dict
    params: list = field(default_factory=list)
    grads: list = field(default_factory=list)  # the gradient sources (grad_in or .grad), any dtype
    exp_avgs: list = field(default_factory=list)
    exp_avg_sqs: list = field(default_factory=list)
    max_sqs: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    outs: list = field(default_factory=list)  # (updated slice, its model-dtype copy) or None
    numel: int = 0


@dataclass
class _Plan:
    signature: list
    params: list  # the parameters stepped, in order
    items: list


class CPUAdam(torch.optim.Optimizer):
    """DeepSpeedCPUAdam's signature, plus `grad_in`, `grad_multipliers` and `copy_out` (see the
    module's docstring)."""

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
        threads: int | None = None,
        chunk_numel: int = CHUNK,
    ):
        if not bias_correction:
            raise ValueError("CPUAdam always applies Adam's bias correction (bias_correction=False is not supported)")
        if not fp32_optimizer_states:
            raise ValueError("CPUAdam keeps its moments in fp32 (fp32_optimizer_states=False is not supported)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.chunk_numel = chunk_numel
        self.threads = threads or max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        self._pool = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="zerotron-cpu-adam") if self.threads > 1 else None
        )
        self.copy_out: dict[torch.Tensor, torch.Tensor] = {}
        self.grad_in: dict[torch.Tensor, torch.Tensor] = {}
        self.grad_multipliers: tuple[torch.Tensor, ...] = ()
        self._plan: _Plan | None = None
        self._local = threading.local()

    def __getstate__(self):
        state = super().__getstate__()
        for key in ("_pool", "_plan", "_local"):
            state.pop(key, None)
        return state

    # ---- the two passes -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._current_plan()
        for p in plan.params:
            self.state[p]["step"] += 1
        multipliers = tuple(self.grad_multipliers)
        self._parallel(len(plan.items), lambda i: self._update(plan.items[i], multipliers))
        return loss

    def _update(self, item: _Item, multipliers: tuple):
        kernel = torch._fused_adamw_ if self.adamw_mode else torch._fused_adam_
        group = item.group
        beta1, beta2 = group["betas"]
        grads = self._fp32(item.grads, multipliers, item.numel)
        kernel(
            item.params,
            grads,
            item.exp_avgs,
            item.exp_avg_sqs,
            item.max_sqs,
            item.steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=group["amsgrad"],
            maximize=False,
        )
        for pair in item.outs:  # the updated slice, still in cache, into its model-dtype copy
            if pair is not None:
                pair[1].copy_(pair[0])

    def _fp32(self, grads: list, multipliers: tuple, numel: int) -> list:
        """The gradient slices as fp32 multiplied by `multipliers`: the slices themselves when
        nothing is to be done, else copies in this thread's scratch buffer (in cache)."""
        if not multipliers and all(g.dtype == torch.float32 for g in grads):
            return grads
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < numel:
            scratch = self._local.scratch = torch.empty(max(numel, self.chunk_numel), dtype=torch.float32)
        out = list(scratch[:numel].split([g.numel() for g in grads]))
        torch._foreach_copy_(out, grads)
        for m in multipliers:
            torch._foreach_mul_(out, m)
        return out

    # ---- running over the pool ------------------------------------------------------------------
    def _parallel(self, count: int, fn) -> None:
        if self._pool is None or count <= 1:
            for i in range(count):
                fn(i)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # parallel over work items, not inside each kernel
        # Each thread takes the next item as it frees up: balanced even when another process
        # takes a core, with one task per thread rather than one per item.
        claim = itertools.count()

        @torch.no_grad()  # grad mode is per thread: pool threads need it too
        def drain():
            for i in iter(lambda: next(claim), None):
                if i >= count:
                    return
                fn(i)

        try:
            for future in [self._pool.submit(drain) for _ in range(self.threads)]:
                future.result()
        finally:
            torch.set_num_threads(threads)

    # ---- the work plan --------------------------------------------------------------------------
    def _current_plan(self) -> _Plan:
        """The work items (slices and their argument lists), built once and reused while the
        tensors stay the same: per-item Python work would otherwise rival the kernels' time."""
        signature = []
        for group in self.param_groups:
            for p in group["params"]:
                g = self._grad(p)
                if g is None:
                    continue
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise ValueError(f"CPUAdam updates fp32 tensors on the CPU; got a {p.dtype} tensor on {p.device}")
                if g.numel() != p.numel() or not g.is_floating_point():
                    raise ValueError(
                        f"CPUAdam: the gradient of a tensor of {p.numel()} elements has {g.numel()} "
                        f"elements of {g.dtype}"
                    )
                out = self.copy_out.get(p)
                signature.append((id(p), g.data_ptr(), g.dtype, None if out is None else out.data_ptr()))
        if self._plan is None or self._plan.signature != signature:
            self._plan = self._build_plan(signature)
        return self._plan

    def _grad(self, p):
        g = self.grad_in.get(p)
        return p.grad if g is None else g

    def _build_plan(self, signature) -> _Plan:
        """Items of about chunk_numel elements: slices of large tensors, or several small tensors
        together (one kernel call over lists), so neither huge tensors nor many small ones leave
        threads idle."""
        params, items = [], []
        for group in self.param_groups:
            item = None
            for p in group["params"]:
                g = self._grad(p)
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                out = self.copy_out.get(p)
                flat = [t.view(-1) for t in (p, g, state["exp_avg"], state["exp_avg_sq"])]
                max_sq = state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
                for start in range(0, p.numel(), self.chunk_numel):
                    end = min(start + self.chunk_numel, p.numel())
                    if item is None:
                        item = _Item(group)
                    for lst, t in zip((item.params, item.grads, item.exp_avgs, item.exp_avg_sqs), flat):
                        lst.append(t[start:end])
                    if max_sq is not None:
                        item.max_sqs.append(max_sq[start:end])
                    item.steps.append(state["step"])
                    item.outs.append(None if out is None else (flat[0][start:end], out.view(-1)[start:end]))
                    item.numel += end - start
                    if item.numel >= self.chunk_numel:
                        items.append(item)
                        item = None
            if item is not None:
                items.append(item)
        return _Plan(signature, params, items)


DeepSpeedCPUAdam = CPUAdam  # the name DeepSpeed scripts import
