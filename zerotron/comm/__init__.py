"""Communication: process groups (groups.py: joining the default group, the groups zerotron makes,
connected as they are made, teardown), zerotron's `Comm` (core.py: every collective the engine
issues, counted and watched; strict mode), and DeepSpeed's `deepspeed.comm` functions over torch.distributed
(api.py), so `import zerotron as deepspeed; deepspeed.comm.all_reduce(t)` works as it reads."""

from ..timeouts import DEFAULT_TIMEOUT, group_timeout, requested_timeout
from .api import *  # noqa: F401,F403 (DeepSpeed's names: get_rank, all_reduce, barrier, ...)
from .api import __all__ as _api_names
from .core import Comm, HostTensor, Work, check_device, comm_for, host_buffer, local_device, strict, to_device
from .groups import (
    cached_groups,
    default_backend,
    init_distributed,
    launched_by_torchrun,
    shared_group,
    shutdown,
    use_local_device,
)

__all__ = [
    "Comm",
    "HostTensor",
    "Work",
    "cached_groups",
    "check_device",
    "comm_for",
    "default_backend",
    "host_buffer",
    "init_distributed",
    "launched_by_torchrun",
    "local_device",
    "shared_group",
    "shutdown",
    "strict",
    "to_device",
    "use_local_device",
    "DEFAULT_TIMEOUT",
    "group_timeout",
    "requested_timeout",
]
__all__ += [name for name in _api_names if name not in __all__]
