"""The user-facing side of ZeRO-3: build a model partitioned (`Init`), look at full weights
(`GatheredParameters`), as DeepSpeed scripts call them."""
from __future__ import annotations

import enum

import torch
import torch.nn as nn


class ZeroParamStatus(enum.Enum):
    """Where a ZeRO-3 parameter's values are, as DeepSpeed's `param.ds_status` says it."""
    AVAILABLE = 1      # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard exists; the parameter reads as an empty placeholder
    INFLIGHT = 3       # being gathered


class Init:
    """Build a model too large for one rank: inside the block every parameter is moved to the meta
    device the moment it is registered (so at most one parameter is ever allocated), and
    `zerotron.initialize` with ZeRO stage 3 then materializes one unit at a time, initializes it,
    keeps this rank's shard and frees the rest. Buffers are built normally.

    Initialization runs each submodule's `reset_parameters()` and then the model's
    `_init_weights(module)` when it has one (Hugging Face models and the reference GPT do), seeded
    identically on every rank.
    """

    def __init__(self, module=None, data_parallel_group=None, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype=None, remote_device=None, pin_memory=False, mpu=None):
        self.enabled = enabled
        self._original = None

    def __enter__(self):
        if self.enabled:
            self._original = original = nn.Module.register_parameter

            def register_on_meta(module, name, param):
                if param is not None and not param.is_meta:  # a tie re-registers the (meta) original
                    param = nn.Parameter(torch.empty_like(param.data, device="meta"), requires_grad=param.requires_grad)
                original(module, name, param)
            nn.Module.register_parameter = register_on_meta
        return self

    def __exit__(self, *exc):
        if self._original is not None:
            nn.Module.register_parameter = self._original
            self._original = None
        return False


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


@torch.no_grad()
def materialize(unit_module: nn.Module, root: nn.Module, params: list[nn.Parameter], device, seed: int) -> None:
    """Give the meta parameters in `params` (all within `unit_module`) real storage and initial values."""
    ids = {id(p) for p in params}
    for p in params:
        if p.is_meta:  # swap, not .data=: a meta tensor cannot take real storage in place
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=p.requires_grad))
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        init = getattr(root, "_init_weights", None)
        for m in unit_module.modules():
            if not any(id(p) in ids for p in m.parameters(recurse=False)):
                continue
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
            if init is not None:
                init(m)


class GatheredParameters:
    """Within the block, the listed ZeRO-3 parameters are whole on every rank (every rank must
    enter). With `modifier_rank`, that rank's changes are broadcast and written back into the
    shards and the fp32 master weights on exit. Parameters that are not partitioned pass through."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.units = []

    def __enter__(self):
        if not self.enabled:  # DeepSpeed's scripts pass enabled=(stage == 3): a plain block then
            return self
        seen = set()
        if any(p.is_meta for p in self.params):
            raise RuntimeError("these parameters were built under zerotron.zero.Init and have no values until "
                               "zerotron.initialize materializes them; load weights after initialize")
        self.persistent = [p for p in self.params if getattr(p, "zt_bucket", None) is not None]
        for p in self.params:
            unit = getattr(p, "zt_unit", None)
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                self.units.append(unit)
        self.units.sort(key=lambda u: u.index)  # the same collective order on every rank
        self.was_gathered = [u.state == "gathered" for u in self.units]
        for u in self.units:
            u.gather()
        return self

    @torch.no_grad()
    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self.modifier_rank is not None:  # small ZeRO-3 parameters kept whole on every rank
            for b in {id(p.zt_bucket): p.zt_bucket for p in self.persistent}.values():
                b.comm.broadcast(b.full, src_group_rank=self.modifier_rank)
                b.master.copy_(b.own_slice(b.full).float())
        for unit, was in zip(self.units, self.was_gathered):
            b = unit.bucket
            if self.modifier_rank is not None:
                unit.comm.broadcast(b.full, src_group_rank=self.modifier_rank)
                b.shard.copy_(b.own_slice(b.full))
                b.master.copy_(b.shard.float())
            if not was:
                unit.release()
        self.units = []
        return False


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
    by_unit: dict[int, list] = {}
    for t in tensors.values():  # units in their index order: the same collectives on every rank
        unit = getattr(t, "zt_unit", None)
        by_unit.setdefault(-1 if unit is None else unit.index, []).append(t)
    state = {}
    for index in sorted(by_unit):
        group = by_unit[index]
        with GatheredParameters(group):
            for t in group:
                value = t.detach()
                if hasattr(t, "tp_split_dim"):
                    value = _gather_tensor_parallel(value, t.tp_split_dim, t.tp_comm, getattr(t, "tp_stride", 1))
                host = value.to("cpu", copy=True)
                for name in names[id(t)]:
                    state[name] = host
    return {name: state[name] for name in module.state_dict()}


def _gather_tensor_parallel(shard: torch.Tensor, dim: int, comm, stride: int = 1) -> torch.Tensor:
    from ..parallel.split import join_parts
    return join_parts(comm.all_gather_list(shard), dim, stride)
