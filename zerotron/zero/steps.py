"""The three ways stages 1-3 take the optimizer step over this rank's master shard, behind one
interface: `inspect(inv_scale)` (make the fp32 gradients the optimizer reads, unscaled; a flag
that is nonzero when any is NaN/Inf), `norms()` (each master run's gradient norm, after inspect)
and `apply(optimizer, clip_coef)` (clip and step). ShardedStates picks one when it adopts the
optimizer.

- WholeShardStep: every master run's fp32 gradient at once, one optimizer step.
- SubGroupStep (DeepSpeed's sub_group_size, stage 3): the fp32 gradients are made, and the
  optimizer steps, one sub-group of master runs at a time, so the step never holds the whole
  shard's fp32 gradients.
- HostStep (optimizer offload with an optimizer that reads the host gradients itself, CPUAdam):
  the gradients are measured as they leave for the host, and the host makes one fused pass
  (offload.FusedHostStep).
"""

from __future__ import annotations

import torch


class WholeShardStep:
    def __init__(self, states):
        self.states = states

    def inspect(self, inv_scale: float | None) -> torch.Tensor | None:
        from ..precision import nonfinite_and_unscale

        self.states.make_master_grads()
        return None if inv_scale is None else nonfinite_and_unscale(self.states.master_grads(), inv_scale)

    def norms(self) -> list[torch.Tensor]:
        return list(torch._foreach_norm(self.states.master_grads()))

    def apply(self, optimizer, clip_coef: torch.Tensor | None) -> None:
        grads = self.states.master_grads()
        if clip_coef is not None and grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        optimizer.step()


class SubGroupStep:
    def __init__(self, states, groups: list[list[int]]):
        """`groups`: lists of indices into states.runs, each stepped at once."""
        self.states, self.groups = states, groups
        self.inv_scale = 1.0  # of the step being taken (inspect's), applied again by apply
        self.run_norms: list[torch.Tensor | None] = []

    def _fp32_grads(self, runs: list[int], inv: torch.Tensor, found: torch.Tensor) -> list[torch.Tensor]:
        """Unscaled fp32 copies of the reduced gradients of master runs `runs`; `found` flags NaN/Inf."""
        states = self.states
        grads = []
        for i in runs:
            b, lo, hi = states.run_in_bucket[i]
            grads.append(states.grads.shard(b)[lo:hi].float())
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        states.peak_fp32_grad_numel = max(states.peak_fp32_grad_numel, sum(g.numel() for g in grads))
        return grads

    def inspect(self, inv_scale: float | None) -> torch.Tensor | None:
        """Checked and measured a sub-group at a time (the fp32 copies are dropped: apply makes them again)."""
        device = self.states.buckets[0].device
        self.inv_scale = 1.0 if inv_scale is None else inv_scale
        found, inv = torch.zeros(1, device=device), torch.full((1,), self.inv_scale, device=device)
        self.run_norms = [None] * len(self.states.runs)
        for runs in self.groups:
            for i, norm in zip(runs, torch._foreach_norm(self._fp32_grads(runs, inv, found))):
                self.run_norms[i] = norm
        return None if inv_scale is None else found

    def norms(self) -> list[torch.Tensor]:
        return self.run_norms

    def apply(self, optimizer, clip_coef: torch.Tensor | None) -> None:
        device = self.states.buckets[0].device
        inv, ignored = torch.full((1,), self.inv_scale, device=device), torch.zeros(1, device=device)
        masters = [m for _, m in self.states.runs]
        for runs in self.groups:  # the optimizer steps the runs that have a gradient, skips the rest
            grads = self._fp32_grads(runs, inv, ignored)
            if clip_coef is not None:
                torch._foreach_mul_(grads, clip_coef.to(device))
            for i, g in zip(runs, grads):
                masters[i].grad = g
            optimizer.step()
            for i in runs:
                masters[i].grad = None


class HostStep:
    def __init__(self, states, fused):
        self.states, self.fused = states, fused  # fused: offload.FusedHostStep

    def inspect(self, inv_scale: float | None) -> torch.Tensor | None:
        self.states.host.gradients_arrived(self.states.buckets, self.states.reduced_shard)
        return self.fused.inspect(inv_scale)

    def norms(self) -> list[torch.Tensor]:
        return self.fused.norms

    def apply(self, optimizer, clip_coef: torch.Tensor | None) -> None:
        self.fused.apply(clip_coef)


def step_for(states, sub_group_numel: int | None):
    """The whole shard at once, or, with DeepSpeed's sub_group_size (stage 3), one sub-group of master
    runs at a time (the fp32 gradient copy made and the optimizer stepped per group): runs of
    masters, each group at most `sub_group_numel` elements (a larger run alone). Fp32 masters that
    are the parameters, and offload, need no sub-groups."""
    if sub_group_numel is None or states.masters_are_params or states.host is not None:
        return WholeShardStep(states)
    groups, size = [[]], 0
    for i, (lo, hi) in enumerate(states._run_bounds):
        if groups[-1] and size + (hi - lo) > sub_group_numel:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += hi - lo
    return SubGroupStep(states, groups) if len(groups) > 1 else WholeShardStep(states)
