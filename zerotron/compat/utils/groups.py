"""`deepspeed.utils.groups`: the process-group accessors DeepSpeed scripts call, answered from the
topology of the most recently initialized zerotron engine (see engines.py).

zerotron's layout (zerotron/topology.py) is pipeline x data x sequence x tensor, tensor innermost.
"Model parallel" here is tensor parallel, as in DeepSpeed with AutoTP. Without an engine the
data-parallel group is the whole world and there is no model parallelism, as in DeepSpeed
without an mpu. The sequence-parallel accessors answer from the engine, or before it from the
sequence-parallel mpu (parallel_state_sp). zerotron has no expert parallelism: that world has one
rank, and asking for its groups is an error that says so.
"""

from __future__ import annotations

import torch.distributed as dist

from .engines import current_engine

mpu = None  # DeepSpeed's module attributes, read by some scripts
mesh_device = None
expert_tensor_parallel_world_size = 1

_NO_EXPERTS = (
    "zerotron has no expert parallelism (Mixture-of-Experts layers are not supported), "
    "so there is no expert-parallel group; the expert-parallel world is 1 rank"
)
_tp_world_size_override = None
_tp_rank_override = None


def _engine():
    return current_engine(required=False) if dist.is_initialized() else None


def _topology():
    engine = _engine()
    return None if engine is None else engine.topology


def _require_dist(what: str):
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what}: torch.distributed is not initialized; call zerotron.init_distributed() "
            "or zerotron.initialize(...) first"
        )


# ---- data parallel ---------------------------------------------------------------------------
def _get_data_parallel_group():
    _require_dist("the data-parallel group")
    t = _topology()
    return dist.group.WORLD if t is None else t.group("dp")


def _get_data_parallel_world_size() -> int:
    if not dist.is_initialized():
        return 1
    t = _topology()
    return dist.get_world_size() if t is None else t.dp


def _get_data_parallel_rank() -> int:
    if not dist.is_initialized():
        return 0
    engine = _engine()
    return dist.get_rank() if engine is None else engine.coords.dp


def _get_data_parallel_group_ranks() -> list[int]:
    if not dist.is_initialized():
        return [0]
    t = _topology()
    return list(range(dist.get_world_size())) if t is None else t.group_ranks("dp", dist.get_rank())


def _get_broadcast_src_rank() -> int:
    """The global rank of data-parallel rank 0 in this rank's data-parallel group."""
    return _get_data_parallel_group_ranks()[0]


def _clone_world_group():
    _require_dist("the world group")
    return dist.group.WORLD


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# ---- tensor ("model") parallel -----------------------------------------------------------------
def get_tensor_model_parallel_group():
    _require_dist("the tensor-parallel group")
    t = _topology()
    if t is None:
        raise RuntimeError(
            "the tensor-parallel group is not initialized: it exists once zerotron.initialize(...) "
            "has built an engine (tensor_parallel.autotp_size in the config)"
        )
    return t.group("tp")


def get_tensor_model_parallel_world_size() -> int:
    if _tp_world_size_override is not None:
        return _tp_world_size_override
    t = _topology()
    return 1 if t is None else t.tp


def get_tensor_model_parallel_rank() -> int:
    if _tp_rank_override is not None:
        return _tp_rank_override
    engine = _engine()
    return 0 if engine is None else engine.coords.tp


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's tensor-parallel group."""
    if not dist.is_initialized():
        return 0
    size = get_tensor_model_parallel_world_size()
    return dist.get_rank() // size * size


def set_tensor_model_parallel_world_size(world_size):
    global _tp_world_size_override
    _tp_world_size_override = world_size


def set_tensor_model_parallel_rank(rank):
    global _tp_rank_override
    _tp_rank_override = rank


get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
_get_model_parallel_world_size = get_tensor_model_parallel_world_size
_get_model_parallel_rank = get_tensor_model_parallel_rank
_get_model_parallel_group = get_tensor_model_parallel_group


# ---- pipeline parallel (zerotron's; DeepSpeed keeps these on its grid) --------------------------
def _get_pipeline_parallel_world_size() -> int:
    t = _topology()
    return 1 if t is None else t.pp


def _get_pipeline_parallel_rank() -> int:
    engine = _engine()
    return 0 if engine is None else engine.coords.pp


def _get_pipeline_parallel_group():
    _require_dist("the pipeline-parallel group")
    t = _topology()
    if t is None:
        raise RuntimeError("the pipeline-parallel group exists once zerotron.initialize(...) has built an engine")
    return t.group("pp")


# ---- sequence parallel (DeepSpeed-Ulysses) ------------------------------------------------------
def _sequence_topology():
    """The engine's topology when it splits sequences, else the sequence-parallel mpu's
    (parallel_state_sp, which accelerate and the Trainer set up before the engine), else None."""
    t = _topology()
    if t is not None and t.sp > 1:
        return t
    from ...long_context.mpu import _topology as sp_topology

    return sp_topology


def _get_sequence_parallel_world_size() -> int:
    t = _sequence_topology() if dist.is_initialized() else None
    return 1 if t is None else t.sp


def _get_sequence_parallel_rank() -> int:
    t = _sequence_topology() if dist.is_initialized() else None
    return 0 if t is None else t.coords(dist.get_rank()).sp


def _get_sequence_parallel_group():
    t = _sequence_topology() if dist.is_initialized() else None
    if t is None:
        raise KeyError(
            "no sequence-parallel group: set sequence_parallel_size in the config, or call "
            "deepspeed.runtime.sequence_parallel.parallel_state_sp.initialize_sequence_parallel(n) first"
        )
    return t.group("sp")


def _get_sequence_data_parallel_world_size() -> int:
    t = _sequence_topology() if dist.is_initialized() else None
    return _get_data_parallel_world_size() if t is None else t.replicas


def _get_sequence_data_parallel_rank() -> int:
    t = _sequence_topology() if dist.is_initialized() else None
    return _get_data_parallel_rank() if t is None else dist.get_rank(t.group("dp"))


def _get_sequence_data_parallel_group():
    t = _sequence_topology() if dist.is_initialized() else None
    return _get_data_parallel_group() if t is None else t.group("dp")


# ---- expert parallel: not in zerotron ------------------------------------------------------------
def _get_expert_parallel_world_size(group_name=None) -> int:
    return 1


def _get_expert_parallel_rank(group_name=None) -> int:
    return 0


def _get_expert_parallel_src_rank(group_name=None) -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _get_expert_parallel_group(group_name=None):
    raise RuntimeError(_NO_EXPERTS)


def _get_expert_parallel_group_ranks(group_name=None):
    raise RuntimeError(_NO_EXPERTS)


def _get_expert_data_parallel_world_size(group_name=None) -> int:
    return _get_data_parallel_world_size()  # with one expert-parallel rank, expert data parallel = data parallel


def _get_expert_data_parallel_rank(group_name=None) -> int:
    return _get_data_parallel_rank()


def _get_expert_data_parallel_group(group_name=None):
    return _get_data_parallel_group()


def _get_expert_data_parallel_group_ranks(group_name=None):
    return _get_data_parallel_group_ranks()


def _get_expert_broadcast_src_rank(group_name=None) -> int:
    return _get_broadcast_src_rank()


def _get_expert_parallel_group_dict() -> dict:
    return {}


def _get_expert_data_parallel_group_dict() -> dict:
    return {}


def _get_max_expert_size():
    return None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    raise RuntimeError(_NO_EXPERTS)


def _get_expert_model_parallel_world_size() -> int:
    return expert_tensor_parallel_world_size


def _create_expert_and_data_parallel(expert_parallel_size_, *args, **kwargs):
    if expert_parallel_size_ != 1:
        raise RuntimeError(_NO_EXPERTS)


def _create_expert_data_and_model_parallel(expert_parallel_size_, mpu=None, *args, **kwargs):
    _create_expert_and_data_parallel(expert_parallel_size_)


def _get_local_all_to_all_group():
    raise RuntimeError(_NO_EXPERTS)


def initialize(ep_size=1, mpu=None):
    """DeepSpeed deprecated this and raises; so does zerotron (MoE's ep_size has no equivalent)."""
    raise RuntimeError(
        "groups.initialize() is deprecated in DeepSpeed and not available in zerotron: process "
        "groups come from zerotron.initialize(...) and the config's parallel sizes"
    )


# ---- ZeRO++ hierarchical partitioning: not in zerotron ---------------------------------------------
def _zero_param_parallel_is_initialized() -> bool:
    return False


def _get_zero_param_intra_parallel_group():
    return None


__all__ = [name for name in dir() if name.startswith(("get_", "set_")) and callable(globals()[name])]
