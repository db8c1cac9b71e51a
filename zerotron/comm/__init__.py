"""Communication: process-group setup and zerotron's `Comm` (core.py: every collective the engine
issues, counted and watched), and DeepSpeed's `deepspeed.comm` functions over torch.distributed
(api.py), so `import zerotron as deepspeed; deepspeed.comm.all_reduce(t)` works as it reads."""
from ..timeouts import DEFAULT_TIMEOUT, group_timeout, requested_timeout
from .api import *  # noqa: F401,F403 (DeepSpeed's names: get_rank, all_reduce, barrier, ...)
from .api import __all__ as _api_names
from .core import (Comm, HostTensor, Work, check_device, comm_for, default_backend, host_buffer, init_distributed,
                   launched_by_torchrun, local_device, shutdown, strict, to_device, use_local_device)

__all__ = ["Comm", "HostTensor", "Work", "check_device", "comm_for", "default_backend", "host_buffer", "init_distributed",
           "launched_by_torchrun", "local_device", "shutdown", "strict", "to_device", "use_local_device",
           "DEFAULT_TIMEOUT", "group_timeout", "requested_timeout"]
__all__ += [name for name in _api_names if name not in __all__]
