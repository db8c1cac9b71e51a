"""Process groups: joining the default group (DeepSpeed's init_distributed), the groups zerotron
makes (once per job, connected as they are made), and tearing them down at exit."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist

from .. import watchdog
from ..timeouts import DEFAULT_TIMEOUT, group_timeout, request
from .core import Comm, _comms, forget_first_operations, local_device


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the process group: DeepSpeed's signature and argument order.

    By default from the launcher's environment (RANK, WORLD_SIZE, ...); with `init_method` (e.g.
    "tcp://host:port") and `rank`/`world_size`, from those. Without either, a plain process becomes
    a world of one, so every code path is the same. `timeout` bounds every collective: the default
    group's, every group zerotron creates, and the watchdog's. `auto_mpi_discovery`,
    `distributed_port`, `verbose` and `config` are accepted for DeepSpeed's callers (zerotron does
    no MPI discovery: launch with torchrun or `zerotron run`).
    """
    request(timeout)
    if dist.is_initialized():  # the script (or accelerate, the Trainer) made the group: still tear it down cleanly
        use_local_device()
        _shutdown_at_exit()
        connect(None)
        return
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed(dist_init_required=False) but no process group exists: initialize "
            "torch.distributed first, or leave dist_init_required unset"
        )
    timeout = group_timeout()
    backend = dist_backend or default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    explicit = {"rank": rank, "world_size": world_size} if rank >= 0 and world_size > 0 else {}
    if launched_by_torchrun() and init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(
            backend,
            store=_attempt_store(timeout),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    elif launched_by_torchrun() or init_method is not None:
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, **explicit)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _shutdown_at_exit()
    connect(None)


def _shutdown_at_exit() -> None:
    global _shutdown_registered
    if not _shutdown_registered:
        atexit.register(shutdown)
        _shutdown_registered = True


_shutdown_registered = False


def shutdown() -> None:
    """At interpreter exit, for scripts that never call destroy_process_group (most DeepSpeed
    scripts): stop the watchdog, then tear the process groups down in order, while Python still
    runs. Left to interpreter finalization, a group's threads could be destroyed mid-flight and
    abort a finished job (SIGABRT, "terminate called without an active exception")."""
    dog = watchdog.current()
    if dog is not None:
        dog.stop()
    # A gloo worker thread drops a finished operation's tensors a moment after wait() returned.
    # A tensor that only the operation still held (a view made for it) then needs the GIL for its
    # Python object; if that moment falls in interpreter finalization, the thread is killed
    # mid-destructor and the job aborts. The groups live on in the engine's objects past
    # destroy_process_group, so give those threads their moment while Python still runs. (A timing
    # mitigation, not a guarantee: 0 aborts in 64 runs of a script that aborted in 4 of ~20 without it.)
    # Scripts that call destroy_process_group themselves (the Transformers and accelerate examples)
    # need that moment too: their groups' threads outlive the call in the engine's objects.
    time.sleep(0.05)
    forget_groups()
    _comms.clear()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a peer already gone: nothing left to tear down)
            pass
    gc.collect()  # groups nothing else holds go now, while Python runs, not in finalization


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's key-value store, namespaced by restart attempt. After an elastic restart the new
    workers must not read the dead ones' entries: torch 2.13 does not separate them, and gloo then
    tries to connect to the dead workers' addresses and fails."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerotron/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def use_local_device() -> None:
    """A script that called dist.init_process_group("nccl") itself did not pick its GPU: every rank
    would use cuda:0. Take LOCAL_RANK's, as init_distributed does."""
    if "nccl" in str(dist.get_backend()) and "LOCAL_RANK" in os.environ:
        local = int(os.environ["LOCAL_RANK"])
        if torch.cuda.current_device() != local and local < torch.cuda.device_count():
            torch.cuda.set_device(local)


# ---- process groups: made once per job, connected as they are made ---------------------------------
# NCCL creates a group's communicator at the group's first operation, and that creation blocks the
# host until every rank of the group has reached its own first operation on it. Left to the
# schedules, a pipeline whose first operation on a flow is a receive deadlocks (stage 0 waits on
# the last stage's link, which waits on stage 0's first forward). So every group is connected
# where it is made: one tiny all-reduce by its members, right after every rank created it. Ranks
# create groups in one order, so each connects its own groups in a subsequence of one global
# order, and the lowest group not yet connected always has all its members waiting on it: no
# launch order, schedule or layout can deadlock on communicator creation. It holds whoever made the
# default group (zerotron, torchrun's script, accelerate); strict mode emulates NCCL's rule on gloo.
_groups: dict = {}


def cached_groups(key, make):
    """`make()`'s process group(s), made once per job (per default group) and connected: every rank
    asks for the same keys in the same order, so every rank creates the same groups."""
    _this_job()
    if key not in _groups:
        made = make()
        for group in made.values() if isinstance(made, dict) else [made]:
            if isinstance(group, dist.ProcessGroup):  # (not GroupMember.NON_GROUP_MEMBER: a group without this rank)
                connect(group)
        _groups[key] = made
    return _groups[key]


def shared_group(ranks: list[int], purpose: str = "") -> dist.ProcessGroup:
    """`dist.new_group(ranks)`, made once per job and `purpose` (every rank must call it with the
    same arguments, in the same order). Two purposes over the same ranks get two groups."""
    return cached_groups(("group", purpose, tuple(ranks)), lambda: dist.new_group(list(ranks), timeout=group_timeout()))


def _this_job() -> None:
    """A new default group in this process (a new job): the old groups are gone."""
    world = dist.group.WORLD
    if _groups.get("world") is not world:
        _groups.clear()
        _groups["world"] = world


def forget_groups() -> None:
    """Drop the cached groups (the job is ending: shutdown)."""
    _groups.clear()
    forget_first_operations()


def connect(group) -> None:
    """Give `group` (None: the default group) its first operation now: see above."""
    comm = Comm(group, "connect")
    if comm.size > 1:
        comm.all_reduce(torch.zeros(1, device=local_device()))
