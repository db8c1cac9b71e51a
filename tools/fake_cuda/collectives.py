"""NCCL's rules for the collectives of a fake GPU's process, over gloo's transport: device tensors only, on this
rank's device; and what the device has queued, for `torch.cuda.synchronize()` to wait for.

`init_process_group("fake_nccl")` makes the group: NCCL's name (zerotron takes its device from "nccl" in the
backend's name) and gloo's processes, for host and "device" tensors alike (both are host memory here)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .oracle import leaves
from .placement import device_of
from .report import FakeCudaError, describe, where

BACKEND = "fake_nccl"
WORK_WAIT = dist.distributed_c10d.Work.wait  # (the session patches Work.wait)


def register_backend() -> None:
    if BACKEND in dist.Backend.backend_list:
        return

    def make(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend(BACKEND, make, devices=["cpu", "cuda"])


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # it failed: the error is its waiter's to report
        return True


class Collectives:
    def __init__(self, runtime):
        self.runtime = runtime
        self.pending: list[tuple[object, str, str]] = []  # (work, collective, where) not known complete
        self.completing = 0  # inside a collective's wait()

    def run(self, func, args, kwargs):
        """A c10d operation: its tensors checked as NCCL checks them, then run; its work remembered."""
        index = self.runtime.index
        for t in leaves([args, kwargs]) if func._opname != "barrier" else ():  # (barrier's tensor is torch's)
            if not isinstance(t, torch.Tensor):
                continue
            device = device_of(t)
            if device.type != "cuda":
                raise FakeCudaError(
                    f"{func._opname} of a {describe(t)} tensor in host memory at {where()}: NCCL refuses host "
                    "tensors (move it to the device first)"
                )
            if device.index != index:
                raise FakeCudaError(
                    f"{func._opname} of a {describe(t)} tensor on {device} while this rank's device is cuda:{index} "
                    f"at {where()}: NCCL runs each rank on one device"
                )
        out = func(*args, **kwargs)
        at = where()
        for work in leaves([out]):
            if isinstance(work, torch.ScriptObject):
                self.pending.append((dist.distributed_c10d.Work.unbox(work), func._opname, at))
        if len(self.pending) > 64:
            self.pending = [p for p in self.pending if not _completed(p[0])]
        return out

    def drain(self, what: str, wait_s: float) -> None:
        """The device finishes what it has queued (torch.cuda.synchronize()): every collective and receive
        this rank posted; one that does not complete in `wait_s` waits for this rank, a deadlock on a GPU."""
        deadline = time.monotonic() + wait_s
        pending, self.pending = self.pending, []
        for work, op, at in pending:
            while not _completed(work):
                if time.monotonic() > deadline:
                    raise FakeCudaError(
                        f"{what} at {where()} waited {wait_s:g} s for {op} posted at {at}, which did not complete: "
                        "on a GPU it waits for everything queued on the device, the collectives and receives "
                        "posted ahead included, and those wait for this rank: a deadlock"
                    )
                time.sleep(0.001)

    def waiting(self):
        """Work.wait as the session sees it: gloo lands some outputs from host buffers of its own during the
        wait (a copy NCCL does not make: it writes the output on the device), which is no transfer of the
        step's; and a work waited on is done (gloo's wait returns then; not every gloo work says so otherwise)."""
        collectives = self

        def wait(work, *args, **kwargs):
            collectives.completing += 1
            try:
                done = WORK_WAIT(work, *args, **kwargs)
            finally:
                collectives.completing -= 1
            collectives.pending = [p for p in collectives.pending if p[0] is not work]
            return done

        return wait
