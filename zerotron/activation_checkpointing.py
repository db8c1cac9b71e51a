"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` API on `torch.utils.checkpoint`.

    from zerotron import checkpointing
    y = checkpointing.checkpoint(block, x)      # as DeepSpeed / Megatron scripts call it

A checkpointed function keeps only its inputs for backward and runs again inside backward to
rebuild what it needs (torch's non-reentrant checkpoint, RNG state replayed so dropout repeats
its masks). What the `activation_checkpointing` config section adds:

- `partition_activations`: with tensor parallelism every rank holds the same block input; each keeps
  only its 1/tp slice and the slices are all-gathered again for the recomputation.
- `cpu_checkpointing`: the kept inputs wait in (pinned) host memory on GPUs.

The engine can also apply checkpointing itself, by policy (`"zerotron": {"checkpoint_policy": ...}`):
`every_block` (each repeated block: transformer layers), `every_k` (every `checkpoint_every`-th
block), or `selective` (each block, keeping matmul outputs and recomputing only the cheap ops:
attention, activations, norms).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .config import CHECKPOINT_POLICIES


class _Settings:
    def __init__(self):
        self.configured = False
        self.partition_activations = False
        self.cpu_checkpointing = False
        self.tp_comm = None  # the tensor-parallel Comm partitioned activations are split over
        self.number_checkpoints = None
        self.contiguous_memory_optimization = False
        self.synchronize_checkpoint_boundary = False
        self.profile = False


_settings = _Settings()


def configure(
    mpu_=None,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
    tp_comm=None,
):
    """DeepSpeed's `checkpointing.configure`: settings from a config (path, dict or zerotron.Config),
    then the explicit arguments on top. `tp_comm` (zerotron's) is the tensor-parallel group."""
    if deepspeed_config is not None:
        from .config import Config

        cfg = (
            deepspeed_config
            if isinstance(deepspeed_config, Config)
            else Config.load(deepspeed_config, world_size=dist.get_world_size() if dist.is_initialized() else 1)
        )
        ac = cfg.activation_checkpointing
        _settings.partition_activations = ac.partition_activations
        _settings.cpu_checkpointing = ac.cpu_checkpointing
        _settings.number_checkpoints = ac.number_checkpoints
        _settings.contiguous_memory_optimization = ac.contiguous_memory_optimization
        _settings.synchronize_checkpoint_boundary = ac.synchronize_checkpoint_boundary
        _settings.profile = ac.profile
    for name, value in (
        ("partition_activations", partition_activations),
        ("cpu_checkpointing", checkpoint_in_cpu),
        ("contiguous_memory_optimization", contiguous_checkpointing),
        ("number_checkpoints", num_checkpoints),
        ("synchronize_checkpoint_boundary", synchronize),
        ("profile", profile),
        ("tp_comm", tp_comm),
    ):
        if value is not None:
            setattr(_settings, name, value)
    if mpu_ is not None and tp_comm is None and hasattr(mpu_, "get_model_parallel_group"):
        from .comm import Comm

        _settings.tp_comm = Comm(mpu_.get_model_parallel_group())
    _settings.configured = True


def is_configured() -> bool:
    return _settings.configured


def reset():
    """Back to defaults (tests; a new engine configures again)."""
    global _settings
    _settings = _Settings()


def checkpoint(function, *args, **kwargs):
    """`function(*args, **kwargs)`, keeping only the inputs for backward and recomputing the rest there."""
    return _checkpoint(function, args, kwargs, selective=False)


def _checkpoint(function, args, kwargs, selective: bool):
    comm = _settings.tp_comm if _settings.partition_activations else None
    if comm is not None and comm.size > 1:
        args, function = _partitioned(args, function, comm)
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        if selective
        else torch.utils.checkpoint.noop_context_fn
    )
    offload = _settings.cpu_checkpointing and torch.cuda.is_available()
    with torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext():
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs
        )


non_reentrant_checkpoint = checkpoint  # DeepSpeed's other name for it


_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.linear.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


# ---- partitioned activations ------------------------------------------------------------------
class _KeepSlice(torch.autograd.Function):
    """Forward: this rank's slice of a tensor every tensor-parallel rank holds alike. Backward:
    the slices' gradients gathered back into the full gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.shape = comm, x.shape
        return x.detach().reshape(-1).chunk(comm.size)[comm.rank].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_flat(grad, ctx.comm).view(ctx.shape), None


class _GatherSlices(torch.autograd.Function):
    """Forward (inside the checkpoint, so again in the recomputation): the full tensor from the
    slices. Backward: this rank's slice of the (identical on every rank) gradient."""

    @staticmethod
    def forward(ctx, piece, comm, shape):
        ctx.comm = comm
        return _gather_flat(piece, comm).view(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(-1).chunk(ctx.comm.size)[ctx.comm.rank].contiguous(), None, None


def _gather_flat(piece, comm):
    out = torch.empty(piece.numel() * comm.size, dtype=piece.dtype, device=piece.device)
    comm.all_gather_flat(out, piece.contiguous())
    return out


def _partitioned(args, function, comm):
    split = [
        torch.is_tensor(a) and a.is_floating_point() and a.numel() % comm.size == 0 and a.numel() > 0 for a in args
    ]
    shapes = [a.shape if s else None for a, s in zip(args, split)]
    pieces = tuple(_KeepSlice.apply(a, comm) if s else a for a, s in zip(args, split))

    def run(*pieces, **kwargs):
        full = (_GatherSlices.apply(p, comm, shape) if shape is not None else p for p, shape in zip(pieces, shapes))
        return function(*full, **kwargs)

    return pieces, run


# ---- policies applied by the engine --------------------------------------------------------------
def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: in each ModuleList / Sequential / ModuleDict, the children of its
    most common class when that class repeats and has parameters (transformer layers). A model of
    which this rank holds only a part (a pipeline stage) names the classes that repeat in the whole
    (`repeated_layer_types()`), so a stage holding one block checkpoints it too."""
    whole = model.repeated_layer_types() if hasattr(model, "repeated_layer_types") else set()
    blocks = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = list(container.children())
        counts = Counter(type(c) for c in children)
        if not counts:
            continue
        cls, n = max(counts.items(), key=lambda kv: (kv[0].__name__ in whole, kv[1]))
        if (n > 1 or cls.__name__ in whole) and any(
            True for _ in children[[type(c) for c in children].index(cls)].parameters()
        ):
            blocks += [c for c in children if type(c) is cls and not any(c is b for b in blocks)]
    return blocks


def apply_policy(model: nn.Module, policy: str, every: int = 2) -> int:
    """Checkpoint the model's repeated blocks by `policy`; returns how many blocks it wraps."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; use one of {', '.join(CHECKPOINT_POLICIES)}")
    if policy == "none":
        return 0
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"checkpoint policy {policy!r} found no repeated blocks in {type(model).__name__} (a "
            "ModuleList of layers); call zerotron.checkpointing.checkpoint in the model instead"
        )
    chosen = blocks[::every] if policy == "every_k" else blocks
    for block in chosen:
        # The module's own __call__ (and its hooks, e.g. ZeRO-3's gathers) stays outside; only the
        # body of forward is recomputed.
        block.forward = functools.partial(
            _checkpointed_forward, type(block).forward.__get__(block), policy == "selective"
        )
    return len(chosen)


def _checkpointed_forward(forward, selective, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return _checkpoint(forward, args, kwargs, selective)
