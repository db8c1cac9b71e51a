"""`deepspeed.utils.torch`: the torch-version gate DeepSpeed's scripts and tests call."""

from __future__ import annotations

import re

import torch


def _release(version) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0): the release numbers, padded so that 2.13 == 2.13.0 as packaging compares."""
    numbers = re.match(r"\d+(\.\d+)*", str(version).strip())
    if numbers is None:
        raise ValueError(f"required_torch_version: {version!r} is not a version number (say e.g. 2.1 or 2.1.0)")
    parts = tuple(int(p) for p in numbers.group(0).split("."))
    return parts + (0,) * (3 - len(parts))


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True when the running torch is at least `min_version` and at most `max_version` (either may be None)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    running = _release(torch.__version__)
    if min_version is not None and running < _release(min_version):
        return False
    return max_version is None or running <= _release(max_version)
