"""`deepspeed.runtime.utils`: the helpers scripts import from it."""

from __future__ import annotations

import gc
import itertools
import math
import os
import random
import resource
import sys

import torch
import torch.distributed as dist

from ...pipe import partition as pipe_partition
from ..utils import groups


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


# ---- partitioning a list of weights (DeepSpeed's pipeline helpers) -------------------------------------------
def prefix_sum_inc(weights) -> list:
    """[3, 4, 5] -> [3, 7, 12]: the inclusive prefix sums."""
    return list(itertools.accumulate(weights))


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """The num_parts + 1 boundaries of near-equal contiguous parts of num_items (the first parts one longer); with
    fewer items than parts, one item per part and empty parts at the end, as DeepSpeed returns them."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return pipe_partition.uniform(num_items, num_parts)


def partition_balanced(weights, num_parts: int) -> list[int]:
    """Boundaries of contiguous parts whose sums are as even as DeepSpeed's rule makes them (the smallest spread
    between heaviest and lightest part: zerotron.pipe.partition, which PipelineModule cuts with); with no more
    weights than parts, partition_uniform's."""
    weights = list(weights)
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return pipe_partition.partition([float(w) for w in weights], num_parts)


# ---- gradient clipping -------------------------------------------------------------------------------------
def _model_parallel_parameter(p) -> bool:
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """Clip the gradients of `parameters` in place to a total norm of `max_norm`; return that norm (a tensor).

    As DeepSpeed's: with `mpu`, the norm is over the model-parallel group (each replicated parameter counted once,
    by model-parallel rank 0); then every rank's norm is averaged over the data-parallel group, so that all ranks
    clip by the same factor even where their gradients differ (expert parameters, which are not all-reduced).
    Must be called on every rank of that group."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    if mpu is not None:
        keep = mpu.get_model_parallel_rank() == 0
        counted = [p for p in parameters if keep or _model_parallel_parameter(p)]
    else:
        counted = parameters
    norms = [p.grad.detach().float().norm(norm_type) for p in counted]
    if norm_type == math.inf:
        total = torch.stack(norms).max() if norms else torch.zeros((), device=device)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        total = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    if dist.is_initialized():
        group = groups._get_data_parallel_group()
        total = total / dist.get_world_size(group=group)
        dist.all_reduce(total, group=group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in parameters:
        p.grad.detach().mul_(coef.to(p.grad.device))
    return total


class PartitionedTensor:
    """DeepSpeed's pipeline engine splits activations over the tensor-parallel group with this class before
    sending them between stages. zerotron's pipeline sends each activation whole (zerotron/pipe/p2p.py), so there is
    nothing to construct: the name exists for imports, construction is refused."""

    def __init__(self, tensor, group, partition_meta=None):
        raise NotImplementedError(
            "PartitionedTensor is DeepSpeed's internal activation partitioning for its pipeline engine; zerotron "
            "sends activations between stages whole and has no such object (partition a tensor with "
            "partition_uniform() and torch.distributed yourself if a script needs it)"
        )
