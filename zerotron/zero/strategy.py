"""The interface every ZeRO stage's model states present to the engines and checkpoints.

Stage 0 (zero/replicated.py: ReplicatedStates), stages 1-2 (zero/sharded.py: ShardedStates) and
stage 3 (zero/stage3.py: Stage3States) implement it; zero.make_model_states picks one. The engine,
the pipeline engine and checkpoint/ call only these members (tests/test_layering.py holds each
class to them).
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch


class ModelStates(Protocol):
    replicated: bool  # every data-parallel rank holds every piece (checkpoints: one rank writes)
    norm_group: object  # the group summing squared gradient norms; None when every rank has the same gradients
    host: object  # the host buffers of optimizer offload, or None

    def adopt(self, optimizer: torch.optim.Optimizer, allow_untested: bool = False) -> None:
        """Take over the optimizer's param groups (masters, shards): from now on it steps these."""

    # ---- backward -----------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """A backward begins; `sync`: it is the accumulation boundary's, whose gradients are reduced."""

    def end_backward(self) -> None:
        """Reduce what is left and wait for every reduction of this backward."""

    def reduce_accumulated(self) -> None:
        """Reduce gradients accumulated without reduction (pipelines: after the last backward)."""

    def reduced_grads(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """After the reduction: the tensors holding `params`' reduced gradients on this rank."""

    # ---- the step -----------------------------------------------------------------------------
    def unscale_and_check(self, inv_scale: float | None) -> torch.Tensor | None:
        """Make the fp32 gradients the optimizer reads (unscaled by `inv_scale`); with a scale, a
        flag tensor that is nonzero when any is NaN/Inf."""

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients of what this rank's optimizer updates (for norms and clipping)."""

    def grad_norms(self) -> list[torch.Tensor]:
        """The L2 norm of each master gradient (after unscale_and_check), for clipping."""

    def apply_update(self, optimizer: torch.optim.Optimizer, clip_coef: torch.Tensor | None) -> None:
        """Scale the master gradients by `clip_coef` (None: leave them) and step the optimizer over
        them (ZeRO-3 with sub_group_size: one sub-group at a time)."""

    def norm_weights(self, tp: int) -> list[float] | None:
        """Per master gradient, the share of its squared norm that counts (tensor-parallel
        replicas, tied copies), or None when every share is 1."""

    def publish(self, from_masters: bool = False) -> None:
        """Write the updated masters into the model's parameters (and gather what is replicated)."""

    def zero_grads(self) -> None:
        """Forget the gradients of the step just taken."""

    # ---- one parameter, from outside a step (DeepSpeed's safe_get/set_* in zerotron.compat) ----------
    def param_shape(self, param: torch.nn.Parameter) -> torch.Size | None:
        """The whole shape of a parameter these states train (a stage-3 one may be a released
        placeholder), or None for one they do not hold."""

    def grad_pieces(self, param: torch.nn.Parameter) -> list[tuple[int, int, torch.Tensor, int]] | None:
        """Where this rank's reduced gradient of `param` is: [(start in the parameter, length,
        tensor, offset in it)]; None when it has no gradient."""

    def grads_changed(self, params: list[torch.nn.Parameter]) -> None:
        """The gradients of `params` were written after backward (offload sends them again)."""

    def republish(self, params: list[torch.nn.Parameter], comm=None) -> None:
        """The masters of `params` changed outside a step: write them into the model's weights on
        every data-parallel rank (every rank calls it with the same parameters; `comm`: the Comm
        to gather over, default the states' own)."""

    # ---- checkpoints and reports --------------------------------------------------------------
    def pieces(self) -> Iterator[tuple[torch.nn.Parameter, int, int, torch.Tensor, int]]:
        """(parameter, start, length, master, offset in master) of each piece this rank updates."""

    def memory(self) -> dict[str, int]:
        """Bytes of gradients and master weights this rank holds ("host": of them, in host memory)."""

    def destroy(self) -> None:
        """Remove the hooks this object put on the model."""


MEMBERS = (
    "replicated",
    "norm_group",
    "host",
    "adopt",
    "begin_backward",
    "end_backward",
    "reduce_accumulated",
    "reduced_grads",
    "unscale_and_check",
    "master_grads",
    "grad_norms",
    "apply_update",
    "norm_weights",
    "publish",
    "zero_grads",
    "param_shape",
    "grad_pieces",
    "grads_changed",
    "republish",
    "pieces",
    "memory",
    "destroy",
)
