"""Copies between host and device, and reading device values, as CUDA does them. A blocking copy makes the host
wait for the stream (torch synchronizes it after the copy), and so does a non-blocking download into pageable
memory. A non-blocking upload from pageable memory is staged by the driver through pinned buffers of its own
("might be synchronous", CUDA's documentation says): listed apart, in the session's `staged`. From pinned
memory, or into it, a non-blocking copy is asynchronous; torch pins a non-blocking download's output."""

from __future__ import annotations

import torch

from .placement import CPU, device_of, on_cuda
from .report import FakeCudaError, Sync, cuda_device, describe, where

aten = torch.ops.aten


def transfer(session, source, to_host: bool, destination=None, non_blocking=False) -> None:
    what = f"copy of {describe(source)} to the {'host' if to_host else 'device'}"
    if source.numel() == 0:  # (torch copies nothing, and waits for nothing)
        return
    if not non_blocking:
        session.host_waits(what)
    elif to_host and destination is not None and not session.memory.is_pinned(destination):
        session.host_waits(what + " (pageable memory)")
    elif not to_host and not session.memory.is_pinned(source):
        session.staged.append(Sync(what + " from pageable memory", where()))


def to_copy(session, func, args, kwargs):
    (x,) = args
    kwargs = session.device_kwarg(kwargs, [x])
    source = device_of(x)
    target = torch.device(cuda_device(kwargs.get("device"), session.runtime.index) or source)
    if source.type == "cpu" and target.type == "cpu":
        return session.on_host(func, args, kwargs)
    if source.type == "cuda" and target.type == "cuda":
        return session.on_device(func, args, {**kwargs, "device": target}, [x])
    session.launch_check(func)
    non_blocking = bool(kwargs.get("non_blocking"))
    transfer(session, x, target.type == "cpu", non_blocking=non_blocking)
    out = func(x, **session.host_kwargs(func, {**kwargs, "device": CPU}))
    if target.type == "cuda":
        session.memory.place(out, target)
    elif non_blocking or kwargs.get("pin_memory"):
        session.memory.pin(out)
    return out


def copy(session, func, args, kwargs):
    destination, source = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    to_device, from_device = on_cuda(destination), on_cuda(source)
    if (not to_device and not from_device) or (session.collectives.completing and to_device):
        return func(*args, **kwargs)
    if to_device and from_device:
        return session.on_device(func, args, kwargs, [destination, source])
    session.launch_check(func)
    session.judge(func, args, kwargs, [destination, source])  # (shapes: a copy may broadcast)
    transfer(session, source, not to_device, destination, non_blocking)
    return func(*args, **kwargs)


def scalar(session, func, args, kwargs):
    if on_cuda(args[0]):
        session.launch_check(func)
        session.host_waits(f"{func} of {describe(args[0])}")
    return func(*args, **kwargs)


def is_pinned(session, func, args, kwargs):
    return session.memory.is_pinned(args[0])


def pin(session, func, args, kwargs):
    if on_cuda(args[0]):
        raise FakeCudaError(f"cannot pin a {device_of(args[0])} tensor: only dense CPU tensors can be pinned")
    out = args[0].clone()
    session.memory.pin(out)
    return out


SPECIAL = {
    aten._to_copy.default: to_copy,
    aten.copy_.default: copy,
    aten._local_scalar_dense.default: scalar,
    aten.is_pinned.default: is_pinned,
    aten._pin_memory.default: pin,
}
