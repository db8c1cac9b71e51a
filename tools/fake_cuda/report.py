"""How the session names what it finds: the error, a host sync, the line of the code under test that did it,
an operand, and "cuda" as CUDA resolves it."""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

import torch

from .placement import device_of


class FakeCudaError(RuntimeError):
    """What a GPU would refuse or hang on, found on the host."""


@dataclass
class Sync:
    what: str  # the call or operation that makes the host wait
    where: str  # the first frame outside torch and this package: file:line

    def __str__(self):
        return f"{self.what} at {self.where}"


def where() -> str:
    """The innermost frame of the code under test (not torch's, not this package's), as path:line."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        f = frame.filename
        if "/torch/" in f or "/fake_cuda/" in f or f.startswith("<") or "/contextlib.py" in f:
            continue
        for root in sys.path[:3]:
            if root and f.startswith(root.rstrip("/") + "/"):
                f = f[len(root.rstrip("/")) + 1 :]
                break
        return f"{f.split('site-packages/')[-1]}:{frame.lineno}"
    return "?"


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def operands(tensors) -> str:
    return ", ".join(f"{describe(t)} on {device_of(t)}" for t in tensors)


def refused(what, tensors=()) -> FakeCudaError:
    return FakeCudaError(f"on CUDA this fails: {what} (at {where()}; operands {operands(tensors)})")


def cuda_device(value, index: int):
    """A device argument as CUDA resolves it: "cuda" is this process's current device."""
    if isinstance(value, str) and value == "cuda":
        return f"cuda:{index}"
    if isinstance(value, torch.device) and value.type == "cuda" and value.index is None:
        return torch.device("cuda", index)
    return value
