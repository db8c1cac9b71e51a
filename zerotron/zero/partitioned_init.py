"""zero.Init: build a model partitioned over the data-parallel ranks as it is built (DeepSpeed's
scheme), each parameter a placeholder plus this rank's flat piece; and the per-parameter status
DeepSpeed scripts read (ds_status)."""

from __future__ import annotations

import enum
import itertools

import torch
import torch.nn as nn

from .flat import FlatBucket
from .residency import Residency, State, holder_of, set_holder


class ZeroParamStatus(enum.Enum):
    """Where a ZeRO-3 parameter's values are, as DeepSpeed's `param.ds_status` says it."""

    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard exists; the parameter reads as an empty placeholder
    INFLIGHT = 3  # being gathered


_ds_ids = itertools.count()  # DeepSpeed's ds_id: construction order, the same on every rank


def built_under_init(p: torch.Tensor) -> bool:
    """Partitioned by zero.Init and not yet taken over by an engine's ZeRO-3 units."""
    return isinstance(holder_of(p), InitPiece)


_STATUS = {
    State.RELEASED: ZeroParamStatus.NOT_AVAILABLE,
    State.GATHERING: ZeroParamStatus.INFLIGHT,
    State.GATHERED: ZeroParamStatus.AVAILABLE,
}


def mark_status(params):
    """An on_change for a Residency: DeepSpeed's ds_status of `params` follows the buffer's state."""

    def on_change(state: State):
        status = _STATUS[state]
        for p in params:
            p.ds_status = status

    return on_change


class InitPiece:
    """A parameter built under zero.Init: this rank keeps its flat piece (DeepSpeed's ds_tensor);
    holding it gathers the whole value from every rank's piece (nested holds count)."""

    order_kind = 0  # GatheredParameters: zero.Init pieces first, in ds_id order

    def __init__(self, p: nn.Parameter, comm, full: torch.Tensor):
        """`p`: a view of `full` (the whole value, padded to a multiple of the ranks)."""
        self.param, self.comm, self.holds = p, comm, 0
        self.layout = FlatBucket([p], comm.size, comm.rank)
        self.residency = Residency(self.layout, full, mark_status([p]))
        p.ds_tensor = self.layout.own_slice(full).clone()
        self.residency.release()

    @property
    def order(self):
        return self.order_kind, self.param.ds_id

    def hold(self) -> None:
        self.holds += 1
        if self.holds > 1:
            return
        p = self.param
        dtype = p.data.dtype  # the placeholder's: a model cast after Init (.to(dtype), initialize) decides
        if p.ds_tensor.dtype != dtype or p.ds_tensor.device != p.data.device:
            p.ds_tensor = p.ds_tensor.to(device=p.data.device, dtype=dtype)
        if self.residency.full.dtype != dtype or self.residency.full.device != p.ds_tensor.device:
            self.residency = Residency.empty(self.layout, dtype, p.ds_tensor.device, mark_status([p]))
        self.residency.start(p.ds_tensor, self.comm)
        self.residency.wait()

    @torch.no_grad()
    def let_go(self, modifier_rank: int | None, keep_values: bool = False) -> None:
        """End of a hold: with `modifier_rank`, that rank's values are broadcast first; every rank
        then cuts its piece from the whole value (`keep_values`: the values every rank computed
        alike are kept), and the last hold's end frees the whole value."""
        p, full, n = self.param, self.residency.full, self.layout.numel
        if modifier_rank is not None or keep_values:
            if p.data.data_ptr() != full.data_ptr():  # the script gave the parameter a new tensor
                full[:n].copy_(p.data.reshape(-1))
            if modifier_rank is not None and self.comm.size > 1:
                self.comm.broadcast(full, src_group_rank=modifier_rank)
            p.ds_tensor = self.layout.own_slice(full).clone()
            if self.holds > 1 and p.data.data_ptr() != full.data_ptr():  # an outer hold reads the new values
                p.data.copy_(full[:n].view(p.data.shape))
        self.holds -= 1
        if self.holds == 0:
            self.residency.release()


class Init:
    """Build a model too large for one rank, partitioned as it is built (DeepSpeed's scheme).

    Inside the block every module's `__init__` runs normally, so each parameter gets its module's
    own initial values; the moment the outermost `__init__` of a module returns, each of its new
    parameters is cut into equal flat pieces over the data-parallel ranks: this rank keeps only
    its piece (`param.ds_tensor`) and the parameter becomes an empty placeholder (`ds_status`
    NOT_AVAILABLE, `ds_shape`, `ds_numel`, `ds_id`). At most one module's own parameters are ever
    whole on a rank.

    A model whose root has `_init_weights(module)` and runs it over its modules inside its own
    `__init__` (the reference GPT; `self.apply(self._init_weights)`) ran it on placeholders; when
    that root's `__init__` returns, `_init_weights` runs again in `apply`'s order, each module's
    parameters gathered around its call. Hugging Face models are left to Transformers' own ZeRO-3
    initialization (`initialize_weights_zero3`, run by `from_config`/`from_pretrained`).

    Every rank holds the same model: as in DeepSpeed, each parameter's initial value is rank 0's
    (broadcast before it is cut, one module at a time), so ranks seeded differently still agree,
    and a model built from one seed equals the model one process builds normally from that seed.

    `GatheredParameters` works on these parameters before `zerotron.initialize` (all-gather,
    `modifier_rank` broadcast, re-cut on exit), and `zerotron.initialize` with ZeRO stage 3 builds
    its units from the pieces, one unit at a time. Buffers are built normally.
    """

    _active = 0  # nested Init blocks: only the outermost one patches

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype=None,
        mpu=None,
        **kwargs,
    ):
        self.enabled = enabled
        self.group = data_parallel_group
        self.dtype = dtype if dtype is not None else _config_dtype(config_dict_or_path if config is None else config)
        self._patched = None
        self._comm = None
        if enabled and module is not None:  # DeepSpeed's Init(module=m): partition an existing model
            for m in module.modules():
                self._partition_module(m)

    @property
    def comm(self):
        if self._comm is None:
            import torch.distributed as dist

            from ..comm import Comm, init_distributed

            if not dist.is_initialized():
                init_distributed()
            self._comm = Comm(self.group, "dp")
        return self._comm

    def __enter__(self):
        if not self.enabled or Init._active:
            Init._active += 1 if self.enabled else 0
            return self
        Init._active += 1
        self.comm  # the process group, before any module is built
        self._patched = {}
        self._depth = 0
        for cls in _module_classes():
            self._wrap(cls)
        init_subclass = nn.Module.__dict__.get("__init_subclass__")
        owner = self

        def wrap_new_class(cls, **kwargs):  # classes defined inside the block
            super(nn.Module, cls).__init_subclass__(**kwargs)
            owner._wrap(cls)

        self._init_subclass = init_subclass
        nn.Module.__init_subclass__ = classmethod(wrap_new_class)
        return self

    def _wrap(self, cls):
        if self._patched is None or cls in self._patched or "__init__" not in cls.__dict__:
            return
        original = cls.__dict__["__init__"]
        owner = self

        def __init__(module, *args, **kwargs):
            # Partition once, after the most derived __init__ (a subclass may still adjust its
            # parent's parameters: DeepSpeed's rule).
            first = not module.__dict__.get("_zt_init_entered", False)
            if first:
                object.__setattr__(module, "_zt_init_entered", True)
                owner._depth += 1
            try:
                original(module, *args, **kwargs)
            finally:
                if first:
                    owner._depth -= 1
                    module.__dict__.pop("_zt_init_entered", None)
            if first:
                owner._partition_module(module)
                if owner._depth == 0:
                    owner._reinit_root(module)

        __init__.__wrapped__ = original
        self._patched[cls] = original
        cls.__init__ = __init__

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        Init._active -= 1
        if self._patched is not None:
            for cls, original in self._patched.items():
                cls.__init__ = original
            if self._init_subclass is None:
                del nn.Module.__init_subclass__
            else:
                nn.Module.__init_subclass__ = self._init_subclass
            self._patched = None
        return False

    @torch.no_grad()
    def _partition_module(self, module: nn.Module) -> None:
        _observe("partition", module)
        for p in module._parameters.values():
            if p is not None and not hasattr(p, "ds_id") and not p.is_meta:
                _partition_param(p, self.comm, self.dtype)

    @torch.no_grad()
    def _reinit_root(self, root: nn.Module) -> None:
        init = getattr(root, "_init_weights", None)
        if init is None or _is_hf_model(root) or not _takes_a_module(init):
            return
        for m in _apply_order(root):  # Module.apply's order; each module's parameters gathered
            params = [p for p in m.parameters(recurse=False) if built_under_init(p)]
            _gather_init(params)
            _observe("reinit", m)
            init(m)
            _reshard_init(params, modifier_rank=0)


def _takes_a_module(fn) -> bool:
    import inspect

    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False


def _apply_order(module: nn.Module):
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _module_classes():
    seen, todo = [], [nn.Module]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def _is_hf_model(module) -> bool:
    import sys

    mu = sys.modules.get("transformers.modeling_utils")
    return mu is not None and isinstance(module, mu.PreTrainedModel)


def _config_dtype(config):
    """DeepSpeed's Init keeps parameters in the config's half type when it enables one."""
    if isinstance(config, str):
        import json

        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        return None
    section = lambda key: config.get(key) if isinstance(config.get(key), dict) else {}  # noqa: E731
    if (section("bf16") or section("bfloat16")).get("enabled") is True:
        return torch.bfloat16
    if section("fp16").get("enabled") is True:
        return torch.float16
    return None


# A test's hook into Init's steps (see tests/test_zero3_hf.py): called with (what, module).
observer = None


def _observe(what, module):
    if observer is not None:
        observer(what, module)


def _piece(numel: int, world: int) -> int:
    return -(-numel // world)


@torch.no_grad()
def _partition_param(p: nn.Parameter, comm, dtype=None) -> None:
    """Keep this rank's flat piece of `p` (DeepSpeed's ds_tensor); `p` becomes a placeholder."""
    from ..comm import local_device

    device = local_device()
    value = p.data
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    n, s = value.numel(), _piece(value.numel(), comm.size)
    full = torch.zeros(s * comm.size, dtype=value.dtype, device=device)
    full[:n].copy_(value.reshape(-1))
    if comm.size > 1:  # rank 0's value: every rank holds the same model, however it was seeded
        comm.broadcast(full, src_group_rank=0)
    p.data = full[:n].view(value.shape)
    p.ds_id = next(_ds_ids)
    p.ds_shape, p.ds_numel, p.ds_persist = value.shape, n, False
    set_holder([p], InitPiece(p, comm, full))


@torch.no_grad()
def copy_partitioned(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters zero.Init partitioned are partitioned again, each the
    copy's own (a plain deep copy would share the originals' pieces and ids). Collective over their
    ranks, like building the module was."""
    import copy

    params = [p for p in module.parameters() if built_under_init(p)]
    if not params:
        return copy.deepcopy(module)
    _gather_init(params)
    try:
        memo = {id(p): nn.Parameter(p.data.clone(), p.requires_grad) for p in params}
        clone = copy.deepcopy(module, memo)
    finally:
        _reshard_init(params, modifier_rank=None, keep_values=False)
    for p in params:
        _partition_param(memo[id(p)], holder_of(p).comm)
    return clone


def take_whole(params) -> None:
    """Make Init-partitioned parameters plain whole ones, their pieces dropped: for a caller that takes
    them over (ZeRO-3's units, the expert-parallel split), collective over their ranks like building."""
    params = [p for p in params if built_under_init(p)]
    _gather_init(params)
    for p in params:
        del p.zt_holder, p.ds_tensor


def _gather_init(params) -> None:
    """Make Init-partitioned parameters whole (nested calls count; one all-gather each, in ds_id order)."""
    for p in sorted(params, key=lambda p: p.ds_id):
        holder_of(p).hold()


def _reshard_init(params, modifier_rank: int | None, keep_values: bool = True) -> None:
    for p in sorted(params, key=lambda p: p.ds_id):
        holder_of(p).let_go(modifier_rank, keep_values)


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


@torch.no_grad()
def materialize(unit_module: nn.Module, root: nn.Module, params: list[nn.Parameter], device, seed: int) -> None:
    """Give the meta parameters in `params` (all within `unit_module`) real storage and initial values."""
    ids = {id(p) for p in params}
    for p in params:
        if p.is_meta:  # swap, not .data=: a meta tensor cannot take real storage in place
            torch.utils.swap_tensors(
                p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            )
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
