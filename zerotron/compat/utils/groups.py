"""`deepspeed.utils.groups`: the process-group accessors DeepSpeed scripts call, answered from the
topology of the most recently initialized zerotron engine (see engines.py).

zerotron's layout (zerotron/topology.py) is pipeline x data x sequence x tensor, tensor innermost.
"Model parallel" here is tensor parallel, as in DeepSpeed with AutoTP. Without an engine the
data-parallel group is the whole world and there is no model parallelism, as in DeepSpeed
without an mpu. The sequence-parallel accessors answer from the engine, or before it from the
sequence-parallel mpu (parallel_state_sp). The expert accessors answer from the expert-parallel
layouts made so far (zerotron/moe/ep_groups.py).
"""

from __future__ import annotations

import torch.distributed as dist

from ...moe import ep_groups
from .engines import current_engine

mpu = None  # DeepSpeed's module attributes, read by some scripts
mesh_device = None
expert_tensor_parallel_world_size = 1

_NO_EXPERTS = (
    "no expert-parallel group has been made: build MoE layers with ep_size > 1 and pass the model to "
    "deepspeed.initialize (or call groups._create_expert_and_data_parallel(N)); until then the "
    "expert-parallel world is 1 rank"
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


# ---- expert parallel (DeepSpeed-MoE) -----------------------------------------------------------------
# DeepSpeed names each layout "ep_size_N"; zerotron's live in zerotron/moe/ep_groups.py, one per size,
# runs of N consecutive ranks trading tokens ("ep") and the ranks with the same place in their run
# holding the same experts ("edp"), DeepSpeed's default layout. Without any, expert parallelism is 1
# rank and the expert-data-parallel group is the data-parallel one.
def _expert_layout(group_name):
    """The layout `group_name` ("ep_size_N") names; None when there are none, or for ep_size_1."""
    made = ep_groups.made()
    if not made or group_name == "ep_size_1":
        return None
    if group_name is None:  # DeepSpeed requires a name; the one layout (or the largest) is meant
        return made[max(made)]
    size = str(group_name).removeprefix("ep_size_")
    if not size.isdigit() or int(size) not in made:
        raise KeyError(
            f"expert parallel group {group_name!r} is not initialized (made: {sorted(f'ep_size_{n}' for n in made)}): "
            "pass a model with MoE(ep_size=N) layers to deepspeed.initialize, call the layer's "
            "set_deepspeed_parallelism(), or groups._create_expert_and_data_parallel(N) first"
        )
    return made[int(size)]


def _expert_group(group_name, dim):
    _require_dist(f"the expert {dim} group")
    t = _expert_layout(group_name)
    if t is None:
        if dim == "edp":
            return _get_data_parallel_group()
        raise RuntimeError(_NO_EXPERTS)
    return t.group(dim)


def _expert_ranks(group_name, dim) -> list[int]:
    t = _expert_layout(group_name) if dist.is_initialized() else None
    if t is None:
        return _get_data_parallel_group_ranks() if dim == "edp" else [dist.get_rank() if dist.is_initialized() else 0]
    return t.group_ranks(dim, dist.get_rank())


def _get_expert_parallel_group(group_name=None):
    return _expert_group(group_name, "ep")


def _get_expert_parallel_group_ranks(group_name=None) -> list[int]:
    return _expert_ranks(group_name, "ep")


def _get_expert_parallel_world_size(group_name=None) -> int:
    return len(_expert_ranks(group_name, "ep"))


def _get_expert_parallel_rank(group_name=None) -> int:
    return _expert_ranks(group_name, "ep").index(dist.get_rank()) if dist.is_initialized() else 0


def _get_expert_parallel_src_rank(group_name=None) -> int:
    """The global rank of expert-parallel rank 0 in this rank's expert-parallel group."""
    return _expert_ranks(group_name, "ep")[0]


def _get_expert_data_parallel_group(group_name=None):
    return _expert_group(group_name, "edp")


def _get_expert_data_parallel_group_ranks(group_name=None) -> list[int]:
    return _expert_ranks(group_name, "edp")


def _get_expert_data_parallel_world_size(group_name=None) -> int:
    return len(_expert_ranks(group_name, "edp"))


def _get_expert_data_parallel_rank(group_name=None) -> int:
    return _expert_ranks(group_name, "edp").index(dist.get_rank()) if dist.is_initialized() else 0


def _get_expert_broadcast_src_rank(group_name=None) -> int:
    """The global rank of expert-data-parallel rank 0 in this rank's expert-data-parallel group."""
    return _expert_ranks(group_name, "edp")[0]


def _get_expert_parallel_group_dict() -> dict:
    return {f"ep_size_{n}": t.group("ep") for n, t in ep_groups.made().items()}


def _get_expert_data_parallel_group_dict() -> dict:
    return {f"ep_size_{n}": t.group("edp") for n, t in ep_groups.made().items()}


def _get_max_expert_size():
    return max(ep_groups.made(), default=None)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    return expert_tensor_parallel_world_size


def _create_expert_and_data_parallel(
    expert_parallel_size_, mp_size=None, pp_size=None, mp_mode="tp", use_data_before_expert_parallel_=False,
    folding_spec=None,
):  # fmt: skip
    """DeepSpeed's default layout (consecutive ranks trade tokens) over data parallelism alone."""
    _require_dist("expert-parallel groups")
    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or folding_spec is not None:
        raise NotImplementedError(
            "expert parallelism with tensor or pipeline parallelism is not supported by zerotron yet: "
            "make the expert-parallel groups over data parallelism alone (mp_size and pp_size 1)"
        )
    if use_data_before_expert_parallel_:
        raise NotImplementedError(
            "use_data_before_expert_parallel_: zerotron lays expert-parallel groups out as consecutive ranks "
            "(DeepSpeed's default); leave it False"
        )
    if expert_parallel_size_ > 1:
        ep_groups.make(expert_parallel_size_)


def _create_expert_data_and_model_parallel(expert_parallel_size_, mpu=None, use_data_before_expert_parallel_=False):
    mp = mpu.get_model_parallel_world_size() if mpu is not None else 1
    _create_expert_and_data_parallel(
        expert_parallel_size_, mp_size=mp, use_data_before_expert_parallel_=use_data_before_expert_parallel_
    )


def _get_local_all_to_all_group():
    raise RuntimeError(
        "the local all-to-all group is ZeRO++'s hierarchical all-to-all (zero_quantized_gradients), "
        "which zerotron does not have"
    )


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
