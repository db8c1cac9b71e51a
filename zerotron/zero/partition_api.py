"""The user-facing side of ZeRO-3: build a model partitioned (`Init`, zero/partitioned_init.py),
look at full weights (`GatheredParameters`, `consolidated_state_dict`), as DeepSpeed scripts call them."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..errors import ZerotronError
from .partitioned_init import Init, ZeroParamStatus, built_under_init  # noqa: F401 (the public surface)
from .residency import holder_of


def refuse_foreign_partitions(module: nn.Module) -> None:
    """Refuse a model whose parameters another engine's zero.Init partitioned (their `ds_status` is not zerotron's
    ZeroParamStatus): their pieces live in that engine's objects, and zerotron would train the empty placeholders.
    It happens the first way in (`import zerotron as deepspeed`) when code that was not edited imports the installed
    DeepSpeed: Transformers' from_pretrained under its HfDeepSpeedConfig (a ZeRO-3 config) builds the model inside
    DeepSpeed's own zero.Init."""
    for name, p in module.named_parameters():
        status = getattr(p, "ds_status", None)
        if status is not None and not isinstance(status, ZeroParamStatus):
            raise ZerotronError(
                f"parameter {name!r} was partitioned by another ZeRO-3 ({type(status).__module__}'s zero.Init), "
                "not zerotron's: zerotron cannot gather it. With `import zerotron as deepspeed`, code you did not "
                "edit still imports the installed DeepSpeed (Transformers' from_pretrained under HfDeepSpeedConfig "
                "builds a ZeRO-3 model in DeepSpeed's zero.Init). Use the alias, so that every `import deepspeed` "
                "is zerotron: `zerotron run --as-deepspeed`, ZEROTRON_AS_DEEPSPEED=1, or zerotron.as_deepspeed() "
                "before importing transformers"
            )


class GatheredParameters:
    """Within the block, the listed ZeRO-3 parameters are whole on every rank (every rank must
    enter). With `modifier_rank`, that rank's changes are broadcast and written back into the
    shards (and, after `zerotron.initialize`, the fp32 master weights) on exit; without one,
    changes are discarded, as in DeepSpeed. Parameters that are not partitioned pass through.

    Before `zerotron.initialize` (parameters built under `zero.Init`) each parameter is gathered
    from its pieces. After it, the units owning the parameters are gathered and pinned: forward
    hooks leave them gathered until the (outermost) block ends, so ranks may run different
    numbers of forwards inside (generation of different lengths)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        seen, unique = set(), []
        for p in params if params is not None else []:
            # (None: a module's absent bias, which Transformers hands in, e.g. resizing an lm_head)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params = unique
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.holders = []

    def __enter__(self):
        if not self.enabled:  # DeepSpeed's scripts pass enabled=(stage == 3): a plain block then
            return self
        if any(p.is_meta for p in self.params):
            raise RuntimeError(
                "these parameters are on the meta device (not built under zerotron.zero.Init, "
                "which gives every parameter real values): they have nothing to gather"
            )
        holders = {id(h): h for h in map(holder_of, self.params) if h is not None}
        self.holders = sorted(holders.values(), key=lambda h: h.order)  # the same collectives on every rank
        for h in self.holders:
            h.hold()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            for h in self.holders:
                h.let_go(self.modifier_rank)
            self.holders = []
        return False


@contextlib.contextmanager
def unwrap_model_for_generation(model: nn.Module):
    """DeepSpeed's `zero.unwrap_model_for_generation` (TRL's generation calls it): `model` (an engine, or its
    module) with every parameter gathered for the block, so that generate() runs without a gather per layer under
    ZeRO-3; training goes on as before after it. Below stage 3 the parameters are whole and nothing is gathered."""
    with GatheredParameters(list(model.parameters())):
        yield model


@torch.no_grad()
def consolidated_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a module partitioned by ZeRO-3 and/or tensor parallelism, in host
    memory on every rank (every rank of the model must call it). One ZeRO-3 unit is gathered at a
    time and each tensor goes to the host as it is complete, so the device never holds more than
    one unit beyond training's own."""
    names: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    tensors = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    by_holder: dict[tuple, list] = {}
    for t in tensors.values():  # holders in their order: the same collectives on every rank
        holder = holder_of(t)
        by_holder.setdefault(() if holder is None else holder.order, []).append(t)
    state = {}
    for order in sorted(by_holder):
        group = by_holder[order]
        with GatheredParameters(group):
            for t in group:
                value = t.detach()
                if hasattr(t, "tp_split_dim"):
                    value = _gather_tensor_parallel(value, t.tp_split_dim, t.tp_comm, getattr(t, "tp_stride", 1))
                host = value.to("cpu", copy=True)
                for name in names[id(t)]:
                    state[name] = host
    return {name: state[name] for name in module.state_dict(keep_vars=True)}


def _gather_tensor_parallel(shard: torch.Tensor, dim: int, comm, stride: int = 1) -> torch.Tensor:
    from ..tensor_parallel.split import join_parts

    return join_parts(comm.all_gather_list(shard), dim, stride)
