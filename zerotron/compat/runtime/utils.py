"""`deepspeed.runtime.utils`: the helpers scripts import from it."""

from __future__ import annotations

import gc
import os
import random
import resource
import sys

import torch
import torch.distributed as dist


def set_random_seed(seed: int):
    """Seed Python's `random`, NumPy's global generator (when NumPy is installed) and torch, as
    DeepSpeed does (NumPy takes the seed modulo 2**32, torch modulo 2**63)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def _host_memory_gb() -> tuple[float | None, float | None]:
    """(used GB, percent used) of host memory, from /proc/meminfo where there is one."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
        return round((total - available) / 2**30, 2), round(100 * (total - available) / total, 1)
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None, None


def see_memory_usage(message, force: bool = False):
    """With force=True, print `message` and the memory in use on rank 0 (device memory on a GPU,
    this process's peak resident memory and the host's use otherwise), as DeepSpeed does."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    print(message)
    gb = 2**30
    if torch.cuda.is_available():
        print(
            f"MA {torch.cuda.memory_allocated() / gb:.2f} GB  Max_MA {torch.cuda.max_memory_allocated() / gb:.2f} GB  "
            f"CA {torch.cuda.memory_reserved() / gb:.2f} GB  Max_CA {torch.cuda.max_memory_reserved() / gb:.2f} GB"
        )
        torch.cuda.reset_peak_memory_stats()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        print(f"process peak RSS {peak / gb:.2f} GB")
    used, percent = _host_memory_gb()
    if used is not None:
        print(f"CPU Virtual Memory:  used = {used} GB, percent = {percent}%")


def empty_cache():
    """Return cached device memory to the driver and reset the peak counters (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def ensure_directory_exists(filename):
    """Create the directory that will hold `filename`."""
    dirname = os.path.dirname(filename)
    if dirname:
        os.makedirs(dirname, exist_ok=True)


def call_to_str(base, *args, **kwargs) -> str:
    """'base(arg, key=value)': a call as text."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def noop_decorator(func):
    return func


def move_to_device(item, device, criterion_func=None):
    """DeepSpeed's: tensors in `item` (nested lists, tuples and dicts) moved to `device`; those
    `criterion_func` accepts keep their identity (their storage moves). Other values pass through
    unchanged (DeepSpeed calls .to() on them)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if hasattr(item, "to") else item
